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
from transformer_jax.models import build
from transformer_jax.models.common import sinusoidal_positions

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
  encoder = build.layer_params(params, "encoder", cfg.num_encoder_layers)
  for layer, p in zip(spec.encoder.layer, encoder):
    _attention(layer.self_attention, p["self_attention"], ("query", "key", "value"))
    _norm(layer.self_attention.layer_norm, p["attention_sublayer"]["norm"])
    _ffn(layer.ffn, p)
  decoder = build.layer_params(params, "decoder", cfg.num_decoder_layers)
  for layer, p in zip(spec.decoder.layer, decoder):
    _attention(layer.self_attention, p["self_attention"], ("query", "key", "value"))
    _norm(layer.self_attention.layer_norm, p["self_attention_sublayer"]["norm"])
    _attention(layer.attention, p["cross_attention"], ("query",), ("key", "value"))
    _norm(layer.attention.layer_norm, p["cross_attention_sublayer"]["norm"])
    _ffn(layer.ffn, p)
  spec.register_source_vocabulary(_padded(pieces, cfg.src_vocab_size))
  spec.register_target_vocabulary(_padded(translator.tokenizers.tgt.pieces(),
                                          cfg.tgt_vocab_size))
  spec.validate()
  spec.optimize(quantization=quantization)
  spec.save(str(out))


def _padded(pieces: list[str], size: int) -> list[str]:
  """The vocabulary with a name for each row the model's table pads it with (unused ids)."""
  return pieces + [f"<unused{i}>" for i in range(len(pieces), size)]


def _linear(spec, kernel: np.ndarray, bias: np.ndarray | None) -> None:
  """A [in, out] kernel as CTranslate2's [out, in] weight."""
  spec.weight = np.ascontiguousarray(kernel.T)
  if bias is not None:
    spec.bias = bias


def _attention(spec, p: dict, *groups: tuple[str, ...]) -> None:
  """Attention projections into CTranslate2's linears: each group of ours (query, key, value
  kernels [D, N, H]) fused into one linear, in order, then the output projection."""
  d = p["out_kernel"].shape[-1]
  for linear, names in zip(spec.linear, groups):
    kernel = np.concatenate([p[f"{n}_kernel"].reshape(d, -1) for n in names], axis=1)
    bias = (np.concatenate([p[f"{n}_bias"].reshape(-1) for n in names])
            if f"{names[0]}_bias" in p else None)
    _linear(linear, kernel, bias)
  _linear(spec.linear[-1], p["out_kernel"].reshape(-1, d), p.get("out_bias"))


def _norm(spec, p: dict) -> None:
  spec.gamma, spec.beta = p["scale"], p["bias"]


def _ffn(spec, p: dict) -> None:
  _norm(spec.layer_norm, p["ffn_sublayer"]["norm"])
  _linear(spec.linear_0, p["ffn"]["wi"]["kernel"], p["ffn"]["wi"]["bias"])
  _linear(spec.linear_1, p["ffn"]["wo"]["kernel"], p["ffn"]["wo"]["bias"])
