"""A translation workdir's model as a CTranslate2 model directory, built with CTranslate2's
Python spec API: the Transformer spec (post- or pre-LN layers, this model's sinusoidal position
table, embeddings scaled by sqrt(d_model)), the shared vocabulary by id, <bos>/<eos>/<unk>
named as the tokenizer names them, the source's <eos> added by CTranslate2. `quantization`
(`--quantization int8`, ...) stores quantized weights; CTranslate2 can also quantize a float32
model when it loads it (`compute_type`). Export only: CTranslate2 has no reader of its own
format into another framework.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import BOS, EOS, UNK
from transformer_jax.decoding.translator import Translator
from transformer_jax.interop import tables
from transformer_jax.models.common import sinusoidal_positions

VMAP_FILE = "vmap.txt"  # Where a CTranslate2 model keeps its vocabulary map.
CT2_DEFAULT_POSITIONS = 1025  # Positions CTranslate2's default length limits can reach.
# The weight types CTranslate2's converter stores (`--quantization`).
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")


def write(translator: Translator, out: Path, quantization: str | None) -> None:
  """The translator's model as a CTranslate2 Transformer spec saved in `out`."""
  from ctranslate2.specs import transformer_spec  # An extra: export.py checks it is there.
  cfg = translator.model.cfg
  # Writable copies: CTranslate2 quantizes in place.
  params = jax.tree.map(lambda x: np.array(x, np.float32), translator.params)
  spec = transformer_spec.TransformerSpec.from_config(
      (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=cfg.pre_ln)
  spec.config.layer_norm_epsilon = cfg.layer_norm_eps
  pieces = translator.tokenizers.src.pieces()
  spec.config.bos_token = spec.config.decoder_start_token = pieces[BOS]
  spec.config.eos_token, spec.config.unk_token = pieces[EOS], pieces[UNK]
  spec.config.add_source_eos = True  # Our sources end with <eos>.

  src_table = params["src_embed"]["embedding"]  # [V, D]
  tgt_table = src_table if cfg.share_embeddings else params["tgt_embed"]["embedding"]
  # Positions 0 .. P - 1 for P covering the longest output translate allows (4 x max_len) and
  # CTranslate2's own default limits (max_input_length 1024, max_decoding_length 256, +1 for
  # <bos>): a call with its defaults must not run past the table.
  rows = max(4 * translator.max_src_len + 1, CT2_DEFAULT_POSITIONS)
  positions = np.array(sinusoidal_positions(jnp.arange(rows)[None], cfg.d_model))[0]  # [P, D]
  spec.encoder.embeddings[0].weight = src_table
  spec.decoder.embeddings.weight = tgt_table
  spec.encoder.position_encodings.encodings = positions
  spec.decoder.position_encodings.encodings = positions
  if cfg.tie_output:
    spec.decoder.projection.weight = tgt_table  # [V, D]: CTranslate2's [out, in].
  else:
    spec.decoder.projection.weight = params["output_proj"]["kernel"].T
    spec.decoder.projection.bias = params["output_proj"]["bias"]
  if cfg.pre_ln:
    _norm(spec.encoder.layer_norm, params["encoder_norm"])
    _norm(spec.decoder.layer_norm, params["decoder_norm"])
  # The layers by the shared table (a model without attention biases gets zero ones).
  layers = tables.to_theirs(tables.CTRANSLATE2_LAYERS, tables.complete(cfg, params), cfg)
  for name, value in layers.items():
    _set(spec, name, value)
  spec.register_source_vocabulary(_padded(pieces, cfg.src_vocab_size))
  spec.register_target_vocabulary(_padded(translator.tokenizers.tgt.pieces(),
                                          cfg.tgt_vocab_size))
  spec.validate()
  spec.optimize(quantization=quantization)
  spec.save(str(out))


def _padded(pieces: list[str], size: int) -> list[str]:
  """The vocabulary with a name for each row the model's table pads it with (unused ids)."""
  return pieces + [f"<unused{i}>" for i in range(len(pieces), size)]


def _set(spec, name: str, value: np.ndarray) -> None:
  """Sets the spec's attribute `name` (dotted, list items by number: `encoder.layer.0....`)."""
  *path, leaf = name.split(".")
  for part in path:
    spec = spec[int(part)] if part.isdigit() else getattr(spec, part)
  setattr(spec, leaf, value)


def _norm(spec, p: dict) -> None:
  spec.gamma, spec.beta = p["scale"], p["bias"]
