"""A trained workdir's model in a form that runs without this project's model code.

  python -m transformer_jax export --workdir runs/fra_eng --to ctranslate2 runs/fra_eng_ct2
  python -m transformer_jax export --workdir runs/fra_eng --to jax runs/fra_eng_jax

`ctranslate2`: a CTranslate2 model directory built with its Python spec API (the Transformer
spec: post- or pre-LN layers, this model's sinusoidal position table, embeddings scaled by
sqrt(d_model), the shared vocabulary by id, <bos>/<eos>/<unk> named as the tokenizer names
them, the source's <eos> added by CTranslate2) and the SentencePiece model beside it
(`tokenizer.model`). `--quantization int8` stores int8 weights; CTranslate2 can also quantize
a float32 model when it loads it (`compute_type`).

`huggingface`: a `transformers` model directory of any family (serving/huggingface.py).

`jax`: serialized `jax.export` programs of the jitted decoder, greedy and beam search, for a
few source widths (any batch size), the parameters as `params.npz` and the SentencePiece
model; `transformer_jax.serving.exported.ExportedTranslator` runs them with jax, NumPy and
SentencePiece only.

Either is built in a new directory beside OUT (`.OUT.partial-XXXX`) and renamed to OUT when
complete: nothing half-written is left, and nothing that exists is cleared.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax import fs
from transformer_jax.decoding import generation
from transformer_jax.data.tokenizer import BOS, EOS, PAD, SPM_FILE, UNK, SentencePiece
from transformer_jax.errors import UserError
from transformer_jax.models.common import sinusoidal_positions
from transformer_jax.decoding.translator import Translator
from transformer_jax.models import build
from transformer_jax.serving import huggingface
from transformer_jax.workdir import Workdir

FORMATS = ("ctranslate2", "jax", "huggingface")
# The weight types CTranslate2's converter stores (`--quantization`).
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")
JAX_MANIFEST = "export.json"
CT2_DEFAULT_POSITIONS = 1025  # Positions CTranslate2's default length limits can reach.
JAX_PARAMS = "params.npz"


class ExportError(UserError, ValueError):
  """The workdir or output cannot be exported."""


def export(workdir: str | Path, to: str, output: str | Path, *, step: int | None = None,
           quantization: str | None = None, beam_size: int | None = None,
           alpha: float | None = None) -> Path:
  """Writes `workdir`'s model (its newest checkpoint that verifies, or `step`) in format `to`
  at `output`. `beam_size`/`alpha` (jax only): the beam search exported, default the
  workdir's decoding settings."""
  output = Path(output)
  if to not in FORMATS:
    raise ExportError(f"--to {to!r}: choose one of {', '.join(FORMATS)}")
  if quantization and to != "ctranslate2":
    raise ExportError("--quantization applies to --to ctranslate2 only")
  if quantization and quantization not in QUANTIZATIONS:
    raise ExportError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
  if output.exists():
    raise ExportError(f"{output} exists; name a new directory for the exported model")
  if Path(workdir).resolve() in output.resolve().parents:
    raise ExportError(f"{output} is inside the workdir {workdir}: name a directory outside it "
                      "(its files are the run's)")
  if alpha is not None and alpha < 0:
    raise ExportError(f"--alpha must be >= 0 (0: no length penalty), got {alpha}")
  fs.check_writable(output, "the output")
  if to == "huggingface":
    if beam_size is not None or alpha is not None:
      raise ExportError("--beam_size and --alpha apply to --to jax only")
    why = huggingface.refusal(workdir)
    if why:
      raise ExportError(f"{workdir} has no Hugging Face counterpart: {why}")
    huggingface.export(workdir, output, step)
    return output
  Workdir(workdir).check_family("encoder_decoder", f"export --to {to}")
  translator = Translator(workdir, step, ema=True)
  if not isinstance(translator.tokenizers.src, SentencePiece):
    raise ExportError(f"{workdir} uses word vocabularies; export needs a SentencePiece workdir")
  with fs.new_directory(output) as partial:
    if to == "ctranslate2":
      _to_ctranslate2(translator, partial, quantization)
    else:
      decode = translator.config.decode
      _to_jax(translator, partial, beam_size or decode.beam_size,
              decode.alpha if alpha is None else alpha)
    (partial / SPM_FILE).write_bytes(translator.tokenizers.src.model_proto)
  logging.info("Exported step %s of %s to %s (%s)", translator.step, workdir, output, to)
  return output


def _to_ctranslate2(translator: Translator, out: Path, quantization: str | None) -> None:
  try:
    from ctranslate2.specs import transformer_spec
  except ImportError:
    raise ExportError("--to ctranslate2 needs CTranslate2: pip install 'transformer_jax[export]'"
                      ) from None
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


def source_widths(max_len: int) -> list[int]:
  """The source widths the jax export compiles for: 16, 32, ... up to max_len."""
  widths, w = [], 16
  while w < max_len:
    widths.append(w)
    w *= 2
  return widths + [max_len]


def _to_jax(translator: Translator, out: Path, beam_size: int, alpha: float,
            margin: int = generation.DecodeOptions.max_len_margin) -> None:
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
  manifest = {"programs": programs, "params": JAX_PARAMS, "tokenizer": SPM_FILE,
              "alpha": alpha, "bos": BOS, "eos": EOS, "pad": PAD, "step": translator.step}
  (out / JAX_MANIFEST).write_text(json.dumps(manifest, indent=2))
