"""A translation workdir's decoder as `jax.export` programs, and what runs them with jax, NumPy
and SentencePiece only.

  python -m transformer_jax export --workdir runs/fra_eng --to jax runs/fra_eng_jax

  from transformer_jax.interop.jax_export import ExportedTranslator
  ExportedTranslator("runs/fra_eng_jax").translate(["I lost."], beam=True)

The directory holds serialized programs of the jitted decoder, greedy and beam search, for a
few source widths (any batch size), their parameters as params.npz and the SentencePiece model,
described by export.json. Loading imports nothing else of this project (no model code, no
flax): `write` imports the decoder only when called.
"""


from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import sentencepiece as spm

JAX_MANIFEST = "export.json"
JAX_PARAMS = "params.npz"
TOKENIZER = "tokenizer.model"  # data/tokenizer.py's SPM_FILE, spelled here to import nothing.


class ExportedTranslator:
  """The decoders of an exported model directory (`write`'s)."""

  def __init__(self, directory: str | Path):
    directory = Path(directory)
    manifest_file = directory / JAX_MANIFEST
    if not manifest_file.is_file():
      raise FileNotFoundError(f"{directory} holds no export.json: not an exported model")
    self.manifest = json.loads(manifest_file.read_text())
    with np.load(directory / self.manifest["params"]) as saved:
      self.params = [saved[k] for k in sorted(saved.files)]
    self.tokenizer = spm.SentencePieceProcessor(
        model_file=str(directory / self.manifest["tokenizer"]))
    self.programs = {(p["beam_size"] > 1, p["width"]):
                     jax.export.deserialize((directory / p["file"]).read_bytes())
                     for p in self.manifest["programs"]}
    self.widths = sorted({width for _, width in self.programs})

  def translate(self, sentences: list[str], beam: bool = False) -> list[str]:
    """Greedy (or the exported beam search's) translations; a source longer than the widest
    program is truncated to it (ending with <eos>)."""
    if not sentences:
      return []
    eos, pad = self.manifest["eos"], self.manifest["pad"]
    rows = [ids + [eos] for ids in self.tokenizer.encode(list(sentences))]
    widest = self.widths[-1]
    rows = [r if len(r) <= widest else r[:widest - 1] + [eos] for r in rows]
    width = next(w for w in self.widths if w >= max(len(r) for r in rows))
    src = np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)  # [B, width]
    tokens = np.asarray(self.programs[beam, width].call(self.params, src))  # [B, max_len]
    out = []
    for row in tokens.tolist():
      ids = row[:row.index(eos)] if eos in row else row
      out.append(self.tokenizer.decode([i for i in ids if i > eos]))
    return out


def source_widths(max_len: int) -> list[int]:
  """The source widths the jax export compiles for: 16, 32, ... up to max_len."""
  widths, w = [], 16
  while w < max_len:
    widths.append(w)
    w *= 2
  return widths + [max_len]


def write(translator, out: Path, beam_size: int, alpha: float, margin: int) -> None:
  """The translator's decoder as `jax.export` programs in `out`, greedy and beam search
  (`beam_size`, `alpha`), for each of `source_widths`, any batch size; outputs of up to
  `margin` (DecodeOptions.max_len_margin) tokens more than the width."""
  from absl import logging  # Writing needs the package and the model; loading, not.
  from transformer_jax.decoding import generation
  leaves, treedef = jax.tree.flatten(translator.params)
  model, vocab = translator.model, translator.tokenizers.tgt.vocab_size
  batch = jax.export.symbolic_shape("b")[0]
  programs = []
  for width in source_widths(translator.max_src_len):
    for beam in sorted({1, beam_size}):
      def decoder(leaves, src, beam=beam, width=width):
        params = jax.tree.unflatten(treedef, leaves)
        # The tokenizer's ids only, as `translate` emits (generation.decoder's vocab).
        return generation.scored(model, params, src, width + margin, beam, alpha,
                                 vocab=vocab)[0][:, 0]
      args = ([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
              jax.ShapeDtypeStruct((batch, width), jnp.int32))
      exported = jax.export.export(jax.jit(decoder))(*args)
      name = f"decoder_beam{beam}_width{width}.jaxexport"
      (out / name).write_bytes(exported.serialize())
      programs.append({"file": name, "beam_size": beam, "width": width,
                       "max_len": width + margin})
      logging.info("Exported %s", name)
  np.savez(out / JAX_PARAMS, **{f"{i:04d}": np.asarray(x) for i, x in enumerate(leaves)})
  manifest = {"programs": programs, "params": JAX_PARAMS, "tokenizer": TOKENIZER,
              "alpha": alpha, "bos": generation.BOS, "eos": generation.EOS, "pad": generation.PAD, "step": translator.step}
  (out / JAX_MANIFEST).write_text(json.dumps(manifest, indent=2))
