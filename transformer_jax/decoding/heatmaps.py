"""Attention heatmaps of one translation, as the d2l chapter shows them.

  python -m transformer_jax visualize --workdir runs/fra_eng "I'm home." --out maps/

Writes one PNG per attention kind and layer (encoder self-attention, decoder self-attention,
cross-attention), each with one panel per head and the tokens on the axes.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax.data.tokenizer import BOS  # noqa: E402
from transformer_jax.decoding.generation import encode_sources, strip  # noqa: E402
from transformer_jax.decoding.options import DecodeOptions  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402
from transformer_jax.models.transformer import Transformer  # noqa: E402


KINDS = {"encoder": "self_attention", "decoder": "self_attention", "cross": "cross_attention"}


def attention_maps(translator: Translator, sentence: str):
  """Greedy translation of `sentence` and its attention weights.

  Returns:
    (source pieces, target pieces, {(kind, layer): [N, rows, cols] weights})
  """
  src = encode_sources(translator.tokenizers.src, [sentence], translator.max_src_len)
  src = src[:, :int((src[0] > 0).sum())]  # No padding columns in the pictures.
  out = translator.decode(src, DecodeOptions(max_len=src.shape[1] + 10))[0][0, 0]
  tgt_out = strip(out)
  tgt_in = np.array([[BOS] + tgt_out], np.int32)
  model = Transformer(dataclasses.replace(translator.model.cfg, attention_weights=True))
  _, state = model.apply({"params": translator.params}, jnp.asarray(src), jnp.asarray(tgt_in),
                         mutable=["intermediates"])
  inter = state["intermediates"]
  maps = {}
  for kind, module in KINDS.items():
    prefix = "encoder" if kind == "encoder" else "decoder"
    layer = 0
    while f"{prefix}_{layer}" in inter:
      maps[kind, layer] = np.asarray(inter[f"{prefix}_{layer}"][module]["attention_weights"][0][0])
      layer += 1
  pieces = lambda tok, ids: [tok.decode([i]) or str(i) for i in ids]
  src_tokens = pieces(translator.tokenizers.src, src[0][:-1]) + ["<eos>"]
  tgt_tokens = ["<bos>"] + pieces(translator.tokenizers.tgt, tgt_out)
  return src_tokens, tgt_tokens, maps


def plot(maps, src_tokens, tgt_tokens, out_dir: Path) -> list[Path]:
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  for (kind, layer), weights in maps.items():
    rows, cols = {"encoder": (src_tokens, src_tokens), "decoder": (tgt_tokens, tgt_tokens),
                  "cross": (tgt_tokens, src_tokens)}[kind]
    heads = weights.shape[0]
    fig, axes = plt.subplots(1, heads, figsize=(2.6 * heads, 2.8), squeeze=False)
    for h, ax in enumerate(axes[0]):
      ax.imshow(weights[h], cmap="Reds", vmin=0.0, vmax=1.0)
      ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
      ax.set_yticks(range(len(rows)), rows if h == 0 else [], fontsize=7)
      ax.set_title(f"head {h + 1}", fontsize=8)
    fig.suptitle(f"{kind} attention, layer {layer + 1}", fontsize=9)
    path = out_dir / f"{kind}_layer{layer + 1}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
  return written
