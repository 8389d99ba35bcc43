"""Checks a ConfigDict once at start-up and turns it into the frozen model config."""

from __future__ import annotations

from pathlib import Path

import ml_collections

from transformer_jax.errors import UserError

SCHEDULES = ("rsqrt", "cosine", "constant")


class ConfigError(UserError, ValueError):
  """A config field holds a value the trainer cannot use."""


def check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError naming the first bad field; compiles and reads nothing."""
  if config.data_dir:
    check(Path(config.data_dir).is_dir(), f"data_dir={config.data_dir!r} is not a directory")
  if config.compiled_train_step:
    check(Path(config.compiled_train_step).is_file(),
           f"compiled_train_step={config.compiled_train_step!r} is not a file")
  check(config.tokenizer in ("sentencepiece", "word"),
         f"tokenizer={config.tokenizer!r} must be 'sentencepiece' or 'word'")
  check(config.overlong in ("drop", "truncate"),
         f"overlong={config.overlong!r} must be 'drop' or 'truncate'")
  check(config.max_len >= 2, f"max_len={config.max_len} must be at least 2")
  check(config.num_workers == "auto" or (str(config.num_workers).isdigit()),
         f"num_workers={config.num_workers!r} must be 'auto' or a count >= 0")
  for field in ("batch_size", "tokenizer_sample", "eval_batch_size", "num_steps", "log_every",
                "eval_every", "checkpoint_every", "keep_checkpoints"):
    check(config[field] > 0, f"{field}={config[field]} must be positive")
  check(config.schedule in SCHEDULES, f"schedule={config.schedule!r} must be one of {SCHEDULES}")
  check(config.peak_flops >= 0, f"peak_flops={config.peak_flops} must be >= 0 (0: known "
        "devices' own)")
  check(config.learning_rate > 0, f"learning_rate={config.learning_rate} must be positive")
  check(config.warmup_steps >= 0, f"warmup_steps={config.warmup_steps} must be >= 0 (0: none)")
  check(config.grad_clip >= 0,
         f"grad_clip={config.grad_clip} must be >= 0 (a gradient-norm bound; 0: no clipping)")
  check(config.weight_decay >= 0, f"weight_decay={config.weight_decay} must be >= 0")
  check(0 <= config.adam_b1 < 1 and 0 <= config.adam_b2 < 1 and config.adam_eps >= 0,
         f"adam_b1={config.adam_b1}, adam_b2={config.adam_b2} must be in [0, 1) and "
         f"adam_eps={config.adam_eps} >= 0")
  check(config.nonfinite in ("stop", "skip"),
         f"nonfinite={config.nonfinite!r} must be 'stop' or 'skip'")
  check(config.max_nonfinite_in_row > 0,
         f"max_nonfinite_in_row={config.max_nonfinite_in_row} must be positive")
  check(config.nan_at_step >= 0, f"nan_at_step={config.nan_at_step} must be >= 0 (0: never)")
  check(config.grad_accum_steps > 0 and config.batch_size % config.grad_accum_steps == 0,
         f"grad_accum_steps={config.grad_accum_steps} must be positive and divide "
         f"batch_size={config.batch_size} (the rows of one optimizer step)")
  check(config.loss_chunks > 0 and config.max_len % config.loss_chunks == 0,
         f"loss_chunks={config.loss_chunks} must be positive and divide max_len={config.max_len}")
  check(0 <= config.concat_prob < 1,
         f"concat_prob={config.concat_prob} must be in [0, 1) (0: no concatenation)")
  check(config.concat_max >= 1, f"concat_max={config.concat_max} must be at least 1 (pairs)")
  check(0 <= config.ema_decay < 1,
         f"ema_decay={config.ema_decay} must be in [0, 1) (0: no moving average)")
  check(0 <= config.label_smoothing < 1,
         f"label_smoothing={config.label_smoothing} must be in [0, 1)")
  check(len(config.mesh_shape) == 3,
         f"mesh_shape={tuple(config.mesh_shape)} must have 3 entries (data, fsdp, tensor)")
  d = config.decode
  check(d.beam_size >= 1, f"decode.beam_size={d.beam_size} must be at least 1 (1: greedy)")
  check(d.alpha >= 0, f"decode.alpha={d.alpha} must be >= 0 (0: no length penalty)")
  check(d.segment_over >= -1, f"decode.segment_over={d.segment_over} must be -1 (split none), "
         "0 (all) or positive")
  check(d.long_beam_size >= 0 and d.long_over >= 0,
         f"decode.long_beam_size={d.long_beam_size} and decode.long_over={d.long_over} must be "
         ">= 0")
  m = config.model
  for field in ("d_model", "num_heads", "ffn_dim", "num_encoder_layers", "num_decoder_layers"):
    check(isinstance(m[field], int) and m[field] > 0,
           f"model.{field}={m[field]!r} must be a positive integer")
  check(m.d_model % m.num_heads == 0,
         f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}")
  check(m.d_model % 2 == 0, f"model.d_model={m.d_model} must be even (sinusoidal positions)")
  check(0 <= m.dropout_rate < 1, f"model.dropout_rate={m.dropout_rate} must be in [0, 1)")
  check(m.dtype in ("float32", "bfloat16"), f"model.dtype={m.dtype!r} must be float32 or bfloat16")
  check(m.attention_impl in ("auto", "xla", "cudnn"),
         f"model.attention_impl={m.attention_impl!r} must be auto, xla or cudnn")
  check(not m.share_embeddings or config.tokenizer == "sentencepiece",
         "model.share_embeddings needs the joint sentencepiece tokenizer")


def base_config() -> ml_collections.ConfigDict:
  """Every field a config can set, with defaults; experiments in configs/ override them."""
  c = ml_collections.ConfigDict()
  c.dataset = "fra_eng"
  c.data_dir = ""  # Local directory with the raw corpus files; empty: download them.
  c.tfds_dir = ""  # Where tfds prepares datasets; empty: ~/tensorflow_datasets.
  # Fitted tokenizers and token-id caches of each split; empty: TFDS_DIR/transformer_jax_cache.
  c.cache_dir = ""
  c.num_workers = "auto"  # grain worker processes building batches: "auto" or a count (0: none).
  c.train_split = "train"
  c.eval_split = "validation"
  c.tokenizer = "sentencepiece"  # Or "word": d2l's word-level vocabularies.
  c.vocab_size = 8000  # SentencePiece only.
  c.tokenizer_sample = 200_000  # Training pairs (spread over the split) the tokenizer is fit on.
  c.max_len = 64  # Tokens per side, <eos> included; also the packed row length.
  c.overlong = "drop"  # Pairs over max_len: "drop" or "truncate" (both counted and logged).
  c.packing = True
  # Concatenation augmentation: each training pair joins the one before it into one longer
  # example (sources joined, targets joined) with probability concat_prob, up to concat_max
  # pairs and max_len tokens a side. Teaches sentences longer than most of the corpus's.
  c.concat_prob = 0.0
  c.concat_max = 2
  c.batch_size = 64  # Rows per global batch (each up to max_len tokens a side).
  c.eval_batch_size = 128
  c.num_eval_batches = -1  # -1: the whole eval split.
  c.num_bleu_sentences = 256  # Greedy-decoded and scored at every evaluation (0: none).
  c.seed = 0

  c.model = ml_collections.ConfigDict(dict(
      d_model=512, num_heads=8, ffn_dim=2048, num_encoder_layers=6, num_decoder_layers=6,
      dropout_rate=0.1, pre_ln=False, attention_bias=True, share_embeddings=True,
      tie_output=True, dtype="float32",
      attention_impl="auto",  # auto: cuDNN fused attention on NVIDIA GPUs in bf16, else XLA.
      scan_layers=False, remat="none"))

  c.num_steps = 10_000
  c.schedule = "rsqrt"
  c.learning_rate = 7e-4  # Peak; the paper's d_model**-0.5 * warmup**-0.5 at base size.
  c.warmup_steps = 4000  # Linear warmup from 0; 0: none (rsqrt then decays from step 1).
  c.adam_b1, c.adam_b2, c.adam_eps = 0.9, 0.98, 1e-9
  c.weight_decay = 0.0
  c.grad_clip = 1.0  # Global gradient-norm bound; 0: no clipping.
  c.label_smoothing = 0.1
  # Microbatches a step's batch is cut into, their gradients summed before the one update: the
  # same update with the activation memory of batch_size / grad_accum_steps rows.
  c.grad_accum_steps = 1
  # Slices of the target length the vocabulary projection and loss run over one at a time
  # (each slice's gradient formed in the forward pass): the [tokens, vocabulary] logits are
  # never whole.
  c.loss_chunks = 1
  # Decay of an exponential moving average of the parameters, kept in the train state and used
  # by evaluation and translate (0: none). The decay is at most (1 + step) / (10 + step).
  c.ema_decay = 0.0
  # A step with a non-finite loss or gradient never changes the parameters. "stop": exit with
  # an error naming it; "skip": go on (counted in the log), until max_nonfinite_in_row in a row.
  c.nonfinite = "stop"
  c.max_nonfinite_in_row = 10
  c.nan_at_step = 0  # Tests: make this step's loss NaN (0: never).

  c.compilation_cache_dir = ""  # JAX's persistent compilation cache; empty: WORKDIR/jax_cache.
  # A train step compiled ahead of time for this config and target (python -m
  # transformer_jax.aot --save_train_step FILE), run instead of compiling it; empty: compile.
  c.compiled_train_step = ""
  c.mesh_shape = (-1, 1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices.
  # How `translate` decodes this run's workdir unless its flags say otherwise: the settings a
  # recipe was scored with (its config.json keeps them).
  c.decode = ml_collections.ConfigDict(dict(
      beam_size=4,  # 1: greedy.
      alpha=0.6,  # GNMT length penalty exponent (beam search).
      segment_over=16,  # Sources of more tokens are translated sentence by sentence (-1: none).
      long_beam_size=0,  # Beam size for sources (or sentences) over long_over tokens; 0: off.
      long_over=16))
  c.log_every = 50
  # Peak FLOP/s of one device, for the model-FLOPs utilisation logged as train/mfu; 0: the
  # vendor's bfloat16 peak where the device is known (H100, A100, TPU v4/v5e/v5p/v6e), else
  # only train/model_flops_per_sec is logged.
  c.peak_flops = 0.0
  c.eval_every = 500
  c.checkpoint_every = 500
  c.keep_checkpoints = 3
  return c


def variants(arg: str | None, known: tuple[str, ...]) -> set[str]:
  """The variants named by `configs/NAME.py:ARG` (comma-separated), each one of `known`.

  Raises:
    ConfigError: an unknown variant (a typo must not silently give the full config).
  """
  given = [a.strip() for a in (arg or "").split(",") if a.strip()]
  unknown = [a for a in given if a not in known]
  check(not unknown, f"unknown config variant {unknown[0] if unknown else ''!r}; this config "
         f"knows {', '.join(repr(k) for k in known)} (configs/NAME.py:VARIANT)")
  return set(given)


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks any config to a run of a few steps that finishes in seconds on a CPU."""
  c.train_split = "train[:4000]"
  c.eval_split = "validation[:256]"
  c.vocab_size = min(c.vocab_size, 500)
  c.max_len = min(c.max_len, 32)
  c.batch_size = 16
  c.eval_batch_size = 64
  c.num_bleu_sentences = 64
  c.model.update(d_model=32, num_heads=4, ffn_dim=64, num_encoder_layers=2,
                 num_decoder_layers=2)
  c.num_steps, c.warmup_steps = 20, 5
  c.log_every, c.eval_every, c.checkpoint_every = 5, 10, 10
  return c


def decode_defaults(saved: ml_collections.ConfigDict) -> dict:
  """The decoding settings a workdir's run was configured with (its config.json's `decode`),
  each missing one (a run older than the section) taken from base_config."""
  return {**base_config().decode.to_dict(), **saved.get("decode", {})}
