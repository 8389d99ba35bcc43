"""The config's schema: one frozen dataclass per section, its defaults written once, its checks.

A config is a nested ml_collections.ConfigDict (what configs/*.py build and `--config.SECTION.
FIELD=VALUE` overrides): one section per dataclass below, each used as is by the subsystem it
configures:

  data       DataConfig       the corpus, tokenizer and input pipeline (transformer_jax.data)
  model      ModelConfig      the Transformer's shape (model.TransformerConfig adds vocabularies)
  optimizer  OptimizerConfig  optax's schedule, Adam and clipping (training/steps.py)
  step       StepConfig       what one train or eval step computes (training/steps.py)
  eval       EvalConfig       how often and on how much the run is evaluated (trainer)
  run        RunConfig        length, logging, checkpoints, devices (trainer)
  decode     DecodeConfig     how `translate` decodes the run's workdir by default

`base_config()` is the dataclasses' defaults as a ConfigDict; `parse` turns a ConfigDict (or a
workdir's config.json, older flat ones included) into a `Config` of sections, each checking its
own fields as it is made. This module imports no subsystem.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from transformer_jax.errors import UserError

SCHEDULES = ("rsqrt", "cosine", "wsd", "constant")
# optax's: AdamW; Muon (optax.contrib.muon: the block matrices orthogonalized, the rest through
# Adam); schedule-free AdamW (optax.contrib.schedule_free_adamw: no schedule, and parameters of
# its own for evaluation).
OPTIMIZERS = ("adamw", "muon", "schedule_free_adamw")
# When a beam search ends (decode.py). "exact": once no live beam can beat the K finished ones
# (the best translation the beam can find; a search with a length penalty often runs to its
# limit). "first_k": once K hypotheses have ended, each an <eos> among the step's K best
# candidates (CTranslate2's rule with patience 1): far fewer steps, the best of those K kept.
BEAM_STOPS = ("exact", "first_k")


class ConfigError(UserError, ValueError):
  """A config field holds a value the trainer cannot use."""


def check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _has_type(value, kind) -> bool:
  if kind is type(None):
    return value is None
  if typing.get_origin(kind) is tuple:  # tuple[int, ...]
    return isinstance(value, (tuple, list)) and all(_has_type(v, int) for v in value)
  if kind is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, kind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Section:
  """A config section: made from its fields, it checks them (ConfigError naming the first bad
  one as `SECTION.FIELD=VALUE`)."""
  NAME = ""

  def __post_init__(self):
    self._check_types()
    self.check()

  def _check_types(self) -> None:
    """Each field holds a value of its annotated type (a config.json edited by hand may hold
    2.5 for a beam size): an int is no bool, a float may be an int, a tuple may be a list."""
    hints = typing.get_type_hints(type(self))
    for f in dataclasses.fields(self):
      value, hint = getattr(self, f.name), hints[f.name]
      options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
      if not any(_has_type(value, t) for t in options):
        names = " or ".join("None" if t is type(None) else getattr(t, "__name__", str(t))
                            for t in options)
        raise ConfigError(f"{self.NAME}.{f.name}={value!r} must be {names}")

  def check(self) -> None:
    pass

  def _positive(self, *fields: str) -> None:
    for f in fields:
      value = getattr(self, f)
      check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
            f"{self.NAME}.{f}={value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
  """The corpus, its tokenizer and the training batches."""
  NAME = "data"
  dataset: str = "fra_eng"
  data_dir: str = ""  # Local directory with the raw corpus files; empty: download them.
  tfds_dir: str = ""  # Where tfds prepares datasets; empty: ~/tensorflow_datasets.
  # Fitted tokenizers and token-id caches of each split; empty: TFDS_DIR/transformer_jax_cache.
  cache_dir: str = ""
  num_workers: str | int = "auto"  # grain processes building batches: "auto" or a count (0: none).
  train_split: str = "train"
  eval_split: str = "validation"
  # "sentencepiece", "word" (d2l's word-level vocabularies), or "huggingface": the tokenizer of
  # the Hugging Face checkpoint that run.init_from names.
  tokenizer: str = "sentencepiece"
  vocab_size: int = 8000  # SentencePiece only.
  tokenizer_sample: int = 200_000  # Training pairs (spread over the split) the tokenizer is fit on.
  max_len: int = 64  # Tokens per side, <eos> included; also the packed row length.
  overlong: str = "drop"  # Pairs over max_len: "drop" or "truncate" (both counted and logged).
  packing: bool = True
  # Concatenation augmentation: each training pair joins the one before it into one longer
  # example (sources joined, targets joined) with probability concat_prob, up to concat_max
  # pairs and max_len tokens a side. Teaches sentences longer than most of the corpus's.
  concat_prob: float = 0.0
  concat_max: int = 2
  batch_size: int = 64  # Rows per global batch (each up to max_len tokens a side).
  # A classifier's share of its training split's labelled texts (labelled.subset: a fixed
  # random subset, the smaller inside the larger); 1.0: all of them.
  train_fraction: float = 1.0

  def check(self):
    # Nothing here reads the filesystem: a trained run's config.json parses wherever the run
    # was moved (the trainer checks data_dir against the disk, training/checks.py).
    check(self.tokenizer in TOKENIZERS,
          f"data.tokenizer={self.tokenizer!r} must be one of {', '.join(TOKENIZERS)}")
    check(self.overlong in ("drop", "truncate"),
          f"data.overlong={self.overlong!r} must be 'drop' or 'truncate'")
    check(self.max_len >= 2, f"data.max_len={self.max_len} must be at least 2")
    check(self.num_workers == "auto" or str(self.num_workers).isdigit(),
          f"data.num_workers={self.num_workers!r} must be 'auto' or a count >= 0")
    self._positive("batch_size", "tokenizer_sample", "vocab_size")
    check(0 <= self.concat_prob < 1,
          f"data.concat_prob={self.concat_prob} must be in [0, 1) (0: no concatenation)")
    check(0 < self.train_fraction <= 1,
          f"data.train_fraction={self.train_fraction} must be in (0, 1] (1: every text)")
    check(self.concat_max >= 1, f"data.concat_max={self.concat_max} must be at least 1 (pairs)")


TOKENIZERS = ("sentencepiece", "word", "huggingface")
FAMILIES = ("encoder_decoder", "decoder_only", "encoder_only")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
# The families whose data is documents (language models), not sentence pairs.
DOCUMENT_FAMILIES = ("decoder_only", "encoder_only")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
  """The Transformer's shape and numerics (the vocabularies come from the tokenizers)."""
  NAME = "model"
  # "encoder_decoder": the paper's translation model; "decoder_only": a GPT-style language
  # model of num_decoder_layers blocks of causal self-attention and FFN (num_encoder_layers=0);
  # "encoder_only": a BERT-style encoder of num_encoder_layers bidirectional blocks, pretrained
  # by masked language modelling (num_decoder_layers=0).
  family: str = "encoder_decoder"
  # Positions added to the embeddings: "sinusoidal" (the paper's) or "learned" (a table of
  # data.max_len rows; language models).
  positions: str = "sinusoidal"
  # The FFN's: "relu" (the paper's), "gelu" (exact, BERT's) or "gelu_tanh" (GPT-2's).
  activation: str = "relu"
  d_model: int = 512
  num_heads: int = 8
  ffn_dim: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1
  pre_ln: bool = False  # False: the paper's post-LN blocks.
  # A LayerNorm over the embedded tokens and positions, before the first block, as BERT has
  # (encoder_only models; what an export to BERT needs).
  embed_norm: bool = False
  attention_bias: bool = True
  # Every LayerNorm's epsilon. 1e-6 is flax's default, which every recipe here was trained with
  # (and a saved config.json from before this field means); the d2l chapter's PyTorch uses 1e-5.
  layer_norm_eps: float = 1e-6
  share_embeddings: bool = True  # One table for source and target (joint vocabulary).
  tie_output: bool = True  # Output projection is the target embedding, transposed.
  dtype: str = "float32"  # Compute dtype ("float32" or "bfloat16"); parameters stay float32.
  # "auto": cuDNN's fused attention on NVIDIA GPUs in bfloat16, splash attention on TPUs
  # (segment ids, no dense mask), else XLA's; "xla"; "cudnn"; "splash" (TPUs; elsewhere it
  # runs interpreted, for tests).
  attention_impl: str | None = "auto"
  scan_layers: bool = False  # nn.scan over layers: compile time independent of depth.
  remat: str = "none"  # Recompute activations in the backward pass: "none", "full", "dots".
  # How the embedding tables' gradients are formed (transformer_jax/models/embedding.py): "auto"
  # (a one-hot product on TPUs, a sorted segment sum on GPUs, scatter-add elsewhere),
  # "scatter", "onehot" or "sorted".
  embed_grad: str = "auto"
  # What the attentions are told of each row: "segments" (a mask from segment ids, for packed
  # rows) or "lengths" (one sequence a row, padding after it: a causal flag and each row's
  # length, which cuDNN applies as its own mask type instead of reading a dense [B, 1, T, S]
  # bias; needs data.packing=False).
  attention_mask: str = "segments"

  def check(self):
    check(self.family in FAMILIES,
          f"model.family={self.family!r} must be one of {', '.join(FAMILIES)}")
    check(self.positions in ("sinusoidal", "learned"),
          f"model.positions={self.positions!r} must be sinusoidal or learned")
    check(self.activation in ACTIVATIONS,
          f"model.activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
    if self.family == "decoder_only":
      check(self.num_encoder_layers == 0, f"model.num_encoder_layers={self.num_encoder_layers} "
            "is a translation field: a decoder_only model has num_decoder_layers blocks (set "
            "model.num_encoder_layers=0)")
      self._positive("d_model", "num_heads", "ffn_dim", "num_decoder_layers")
    elif self.family == "encoder_only":
      check(self.num_decoder_layers == 0, f"model.num_decoder_layers={self.num_decoder_layers} "
            "is a decoder field: an encoder_only model has num_encoder_layers blocks (set "
            "model.num_decoder_layers=0)")
      self._positive("d_model", "num_heads", "ffn_dim", "num_encoder_layers")
    else:
      check(self.positions == "sinusoidal", f"model.positions={self.positions!r} is for "
            "language models (an encoder-decoder adds sinusoidal positions)")
      self._positive("d_model", "num_heads", "ffn_dim", "num_encoder_layers",
                     "num_decoder_layers")
    check(not self.embed_norm or self.family == "encoder_only", f"model.embed_norm=True is "
          f"BERT's LayerNorm after the embeddings: encoder_only models only, not "
          f"model.family={self.family!r}")
    check(self.d_model % self.num_heads == 0,
          f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}")
    check(self.d_model % 2 == 0, f"model.d_model={self.d_model} must be even (sinusoidal "
          "positions)")
    check(0 <= self.dropout_rate < 1, f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")
    check(0 < self.layer_norm_eps < 1,
          f"model.layer_norm_eps={self.layer_norm_eps} must be in (0, 1)")
    check(self.dtype in ("float32", "bfloat16"),
          f"model.dtype={self.dtype!r} must be float32 or bfloat16")
    check(self.attention_impl in ("auto", "xla", "cudnn", "splash"),
          f"model.attention_impl={self.attention_impl!r} must be auto, xla, cudnn or splash")
    check(self.remat in ("none", "full", "dots"),
          f"model.remat={self.remat!r} must be none, full or dots")
    check(self.embed_grad in ("auto", "scatter", "onehot", "sorted"),
          f"model.embed_grad={self.embed_grad!r} must be auto, scatter, onehot or sorted")
    check(self.attention_mask in ("segments", "lengths"),
          f"model.attention_mask={self.attention_mask!r} must be segments or lengths")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Section):
  """One of optax's optimizers with global-norm clipping and a learning-rate schedule over
  run.num_steps."""
  NAME = "optimizer"
  name: str = "adamw"  # One of OPTIMIZERS.
  # One of SCHEDULES: "rsqrt" (the paper's), "cosine" (to 0), "wsd" (warmup, stable, then a
  # linear decay to 0 over the last decay_fraction of the run), "constant" (schedule-free's:
  # after its warmup).
  schedule: str = "rsqrt"
  learning_rate: float = 7e-4  # Peak; the paper's d_model**-0.5 * warmup**-0.5 at base size.
  warmup_steps: int = 4000  # Linear warmup from 0; 0: none (rsqrt then decays from step 1).
  decay_fraction: float = 0.2  # "wsd": the share of run.num_steps its decay takes.
  adam_b1: float = 0.9  # Schedule-free's interpolation (its b1) too.
  adam_b2: float = 0.98
  adam_eps: float = 1e-9
  # Decoupled, on the matrices (Muon: those it orthogonalizes); never on biases and norms.
  weight_decay: float = 0.0
  grad_clip: float = 1.0  # Global gradient-norm bound; 0: no clipping.
  # Muon: the momentum of its orthogonalized updates, and their learning rate as a multiple of
  # learning_rate (the embeddings, norms and biases take learning_rate through Adam). Its
  # updates are scaled to AdamW's RMS (0.2, "Muon is Scalable"), so one rate suits both.
  muon_beta: float = 0.95
  muon_lr_scale: float = 1.0

  def check(self):
    check(self.name in OPTIMIZERS,
          f"optimizer.name={self.name!r} must be one of {', '.join(OPTIMIZERS)}")
    check(self.schedule in SCHEDULES,
          f"optimizer.schedule={self.schedule!r} must be one of {SCHEDULES}")
    check(self.name != "schedule_free_adamw" or self.schedule == "constant",
          f"optimizer.name='schedule_free_adamw' follows no schedule: set optimizer.schedule="
          f"'constant' (it warms up over optimizer.warmup_steps), not {self.schedule!r}")
    check(0 < self.decay_fraction <= 1,
          f"optimizer.decay_fraction={self.decay_fraction} must be in (0, 1]")
    check(0 <= self.muon_beta < 1, f"optimizer.muon_beta={self.muon_beta} must be in [0, 1)")
    check(self.muon_lr_scale > 0,
          f"optimizer.muon_lr_scale={self.muon_lr_scale} must be positive")
    check(self.learning_rate > 0,
          f"optimizer.learning_rate={self.learning_rate} must be positive")
    check(self.warmup_steps >= 0,
          f"optimizer.warmup_steps={self.warmup_steps} must be >= 0 (0: none)")
    check(self.grad_clip >= 0, f"optimizer.grad_clip={self.grad_clip} must be >= 0 (a "
          "gradient-norm bound; 0: no clipping)")
    check(self.weight_decay >= 0, f"optimizer.weight_decay={self.weight_decay} must be >= 0")
    check(0 <= self.adam_b1 < 1 and 0 <= self.adam_b2 < 1 and self.adam_eps >= 0,
          f"optimizer.adam_b1={self.adam_b1}, optimizer.adam_b2={self.adam_b2} must be in "
          f"[0, 1) and optimizer.adam_eps={self.adam_eps} >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig(_Section):
  """What one train step computes beyond the model: loss, accumulation, moving average."""
  NAME = "step"
  label_smoothing: float = 0.1
  # Microbatches a step's batch is cut into, their gradients summed before the one update: the
  # same update with the activation memory of batch_size / grad_accum_steps rows.
  grad_accum_steps: int = 1
  # Slices of the target length the vocabulary projection and loss run over one at a time
  # (each slice's gradient formed in the forward pass): the [tokens, vocabulary] logits are
  # never whole.
  loss_chunks: int = 1
  # Decay of an exponential moving average of the parameters, kept in the train state and used
  # by evaluation and translate (0: none). The decay is at most (1 + step) / (10 + step).
  ema_decay: float = 0.0
  nan_at_step: int = 0  # Tests: make this step's loss NaN (0: never).
  # A masked language model's targets (training/steps.py Masking): "pieces", BERT's (each
  # piece chosen with probability mask_rate), or "words" (each word with a letter or digit
  # chosen whole; spaces, newlines and punctuation never).
  masking: str = "pieces"
  mask_rate: float = 0.15

  def check(self):
    check(0 <= self.label_smoothing < 1,
          f"step.label_smoothing={self.label_smoothing} must be in [0, 1)")
    self._positive("grad_accum_steps", "loss_chunks")
    check(0 <= self.ema_decay < 1,
          f"step.ema_decay={self.ema_decay} must be in [0, 1) (0: no moving average)")
    check(self.masking in ("pieces", "words"),
          f"step.masking={self.masking!r} must be 'pieces' or 'words'")
    check(0 < self.mask_rate < 1, f"step.mask_rate={self.mask_rate} must be in (0, 1)")
    check(self.nan_at_step >= 0, f"step.nan_at_step={self.nan_at_step} must be >= 0 (0: never)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig(_Section):
  """The evaluations on the eval split during training (loss, accuracy, greedy BLEU)."""
  NAME = "eval"
  every: int = 500  # Steps between evaluations (and one at the last step).
  batch_size: int = 128
  num_batches: int = -1  # -1: the whole eval split.
  bleu_sentences: int = 256  # Greedy-decoded and scored at every evaluation (0: none).

  def check(self):
    self._positive("every", "batch_size")
    check(self.num_batches == -1 or self.num_batches > 0,
          f"eval.num_batches={self.num_batches} must be positive or -1 (all)")
    check(self.bleu_sentences >= 0, f"eval.bleu_sentences={self.bleu_sentences} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(_Section):
  """How long the run trains, what it logs and keeps, and on which devices."""
  NAME = "run"
  num_steps: int = 10_000
  seed: int = 0
  log_every: int = 50
  checkpoint_every: int = 500
  keep_checkpoints: int = 3
  # A step with a non-finite loss or gradient never changes the parameters. "stop": exit with
  # an error naming it; "skip": go on (counted in the log), until max_nonfinite_in_row in a row.
  nonfinite: str = "stop"
  max_nonfinite_in_row: int = 10
  mesh_shape: tuple[int, ...] = (-1, 1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices.
  # Peak FLOP/s of one device, for the model-FLOPs utilisation logged as train/mfu; 0: the
  # vendor's bfloat16 peak where the device is known (H100, A100, TPU v4/v5e/v5p/v6e), else
  # only train/model_flops_per_sec is logged.
  peak_flops: float = 0.0
  compilation_cache_dir: str = ""  # JAX's persistent compilation cache; empty: WORKDIR/jax_cache.
  # A train step compiled ahead of time for this config and target (python -m transformer_jax
  # aot --save_train_step FILE), run instead of compiling it; empty: compile.
  compiled_train_step: str = ""
  # Fine-tuning: start at step 0, with a fresh optimizer state, from the parameters of this
  # trained workdir's newest checkpoint, with its tokenizer (finetune.py); empty: from scratch.
  init_from: str = ""

  def __post_init__(self):
    object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))  # A JSON list, say.
    super().__post_init__()

  def check(self):
    self._positive("num_steps", "log_every", "checkpoint_every", "keep_checkpoints",
                   "max_nonfinite_in_row")
    check(self.nonfinite in ("stop", "skip"),
          f"run.nonfinite={self.nonfinite!r} must be 'stop' or 'skip'")
    check(len(self.mesh_shape) == 3,
          f"run.mesh_shape={self.mesh_shape} must have 3 entries (data, fsdp, tensor)")
    check(all(s > 0 or s == -1 for s in self.mesh_shape),
          f"run.mesh_shape={self.mesh_shape}: each entry must be a device count of at least 1, "
          "or -1 (the devices left)")
    check(self.peak_flops >= 0, f"run.peak_flops={self.peak_flops} must be >= 0 (0: known "
          "devices' own)")
    # The data order's generator (NumPy's) takes a non-negative seed, jax's keys 64 bits.
    check(0 <= self.seed < 2 ** 63, f"run.seed={self.seed} must be in [0, 2**63)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig(_Section):
  """How `translate` decodes this run's workdir unless its flags say otherwise: the settings a
  recipe was scored with (its config.json keeps them)."""
  NAME = "decode"
  beam_size: int = 4  # 1: greedy.
  alpha: float = 0.6  # GNMT length penalty exponent (beam search).
  segment_over: int = 16  # Sources of more tokens are translated sentence by sentence (-1: none).
  long_beam_size: int = 0  # Beam size for sources (or sentences) over long_over tokens; 0: off.
  long_over: int = 16
  # When a beam search ends (BEAM_STOPS above): "first_k" once K hypotheses have ended, as
  # CTranslate2 does; "exact" once no live beam can beat the finished ones (more steps).
  beam_stop: str = "first_k"

  def check(self):
    check(self.beam_stop in BEAM_STOPS,
          f"decode.beam_stop={self.beam_stop!r} must be one of {', '.join(BEAM_STOPS)}")
    check(self.beam_size >= 1,
          f"decode.beam_size={self.beam_size} must be at least 1 (1: greedy)")
    check(self.alpha >= 0, f"decode.alpha={self.alpha} must be >= 0 (0: no length penalty)")
    check(self.segment_over >= -1, f"decode.segment_over={self.segment_over} must be -1 "
          "(split none), 0 (all) or positive")
    check(self.long_beam_size >= 0 and self.long_over >= 0,
          f"decode.long_beam_size={self.long_beam_size} and decode.long_over={self.long_over} "
          "must be >= 0")


SECTIONS: dict[str, type[_Section]] = {
    s.NAME: s for s in (DataConfig, ModelConfig, OptimizerConfig, StepConfig, EvalConfig,
                        RunConfig, DecodeConfig)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """A whole config, one field per section; checks what spans sections."""
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  step: StepConfig = dataclasses.field(default_factory=StepConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)

  def __post_init__(self):
    data, step = self.data, self.step
    check(data.batch_size % step.grad_accum_steps == 0,
          f"step.grad_accum_steps={step.grad_accum_steps} must divide data.batch_size="
          f"{data.batch_size} (the rows of one optimizer step)")
    check(data.max_len % step.loss_chunks == 0,
          f"step.loss_chunks={step.loss_chunks} must divide data.max_len={data.max_len}")
    family = self.model.family
    if family in DOCUMENT_FAMILIES:  # Translation fields a language model cannot use.
      for field, value, ok, why in (
          ("eval.bleu_sentences", self.eval.bleu_sentences, 0, "BLEU scores translations"),
          ("data.concat_prob", data.concat_prob, 0.0, "it joins sentence pairs")):
        check(value == ok, f"{field}={value!r} is a translation field ({why}): set it to "
              f"{ok!r} for model.family={family!r}")
      check(data.tokenizer != "word", "data.tokenizer='word' is a translation field (documents "
            "take a lossless SentencePiece, or a checkpoint's own tokenizer): set it to "
            f"'sentencepiece' for model.family={family!r}")
    check(self.model.attention_mask == "segments" or not data.packing,
          f"model.attention_mask={self.model.attention_mask!r} takes one sequence a row: set "
          "data.packing=False (packed rows need attention_mask='segments')")
    check(not self.model.share_embeddings or data.tokenizer != "word",
          "model.share_embeddings needs one joint tokenizer (data.tokenizer='sentencepiece')")
    check(not (self.step.ema_decay and self.optimizer.name == "schedule_free_adamw"),
          f"step.ema_decay={self.step.ema_decay} and optimizer.name='schedule_free_adamw' "
          "both make the parameters evaluation reads: set step.ema_decay=0 (schedule-free "
          "already averages)")
    check(data.tokenizer != "huggingface" or self.run.init_from,
          "data.tokenizer='huggingface' is the tokenizer of the Hugging Face checkpoint that "
          "run.init_from names: set run.init_from")

  def to_dict(self) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(self)

  @property
  def eval_params_kept(self) -> bool:
    """Whether the train state keeps parameters of their own for evaluation, decoding and
    checkpoint averaging (`ema_params`): a moving average, or schedule-free's."""
    return self.step.ema_decay > 0 or self.optimizer.name == "schedule_free_adamw"


def base_config() -> ml_collections.ConfigDict:
  """Every field a config can set, with the sections' defaults; configs/ override them."""
  return ml_collections.ConfigDict(Config().to_dict())


# Fields that had other names when the config was flat (config.json of older workdirs).
_FLAT_RENAMED = {"eval_every": ("eval", "every"), "eval_batch_size": ("eval", "batch_size"),
                 "num_eval_batches": ("eval", "num_batches"),
                 "num_bleu_sentences": ("eval", "bleu_sentences")}


def _flat_homes() -> dict[str, tuple[str, str]]:
  """Each field name of the flat config -> (section, field) it is now."""
  home = dict(_FLAT_RENAMED)
  for name, section in SECTIONS.items():
    for f in dataclasses.fields(section):
      home.setdefault(f.name, (name, f.name))  # batch_size: data's (eval's was eval_batch_size).
  return home


def moved(flat_name: str) -> str | None:
  """`SECTION.FIELD` of a field the flat config called `flat_name` (None: no such field)."""
  home = _flat_homes().get(flat_name)
  return home and ".".join(home)


def _unflattened(saved: dict[str, Any]) -> dict[str, Any]:
  """A config.json written before the config had sections, in sections."""
  home = _flat_homes()
  nested: dict[str, Any] = {}
  for key, value in saved.items():
    if key in SECTIONS and isinstance(value, Mapping):
      nested.setdefault(key, {}).update(value)
    elif key in home:
      section, name = home[key]
      nested.setdefault(section, {})[name] = value
    else:
      nested[key] = value  # Unknown: parse names it.
  return nested


# Keys by which another program's config.json names itself (transformers' and the Hub's).
_OTHER_PROGRAMS_KEYS = ("model_type", "architectures", "transformers_version", "_name_or_path")


def why_not_a_runs_config(saved: Mapping[str, Any]) -> str | None:
  """None where a saved JSON object is a config of this project: in sections (what train.py
  writes), or flat from before sections with most of its keys this project's fields; else why
  not, in a few words. Another program's config.json may share a field name (`vocab_size`):
  that alone does not make it a run's."""
  if marks := [k for k in _OTHER_PROGRAMS_KEYS if k in saved]:
    kind = saved.get("model_type")
    return ("it is a Hugging Face model's config" + (f", model_type {kind!r}" if
            isinstance(kind, str) else f", with {marks[0]!r}"))
  homes = _flat_homes()
  ours = [k for k in saved if k in SECTIONS or k in homes]
  if not ours:
    return "it names none of the config's sections or fields"
  if 2 * len(ours) < len(saved):
    others = sorted(k for k in saved if k not in ours)
    return (f"{len(others)} of its {len(saved)} keys are no field of this config, such as "
            f"{others[0]!r}")
  return None


# Fields added after runs were saved, and the value a saved config without them was trained
# with (a default may change; what an old run computed may not).
_VALUE_BEFORE_FIELD = {("model", "layer_norm_eps"): 1e-6, ("model", "family"): "encoder_decoder",
                       ("model", "positions"): "sinusoidal", ("model", "activation"): "relu",
                       ("model", "embed_norm"): False}


def parse(config: ml_collections.ConfigDict | Mapping[str, Any] | Config,
          saved: bool = False) -> Config:
  """The sections of a config, each checked.

  `config` may be flat (a config.json written before sections). `saved`: a workdir's
  config.json: fields this version does not know are dropped instead of refused, and fields it
  lacks get the value they had before they existed (`_VALUE_BEFORE_FIELD`).

  Raises:
    ConfigError: an unknown section or field, or a bad value (named as SECTION.FIELD=VALUE).
  """
  if isinstance(config, Config):
    return config
  raw = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  if any(k not in SECTIONS for k in raw):
    raw = _unflattened(raw)
  if saved:
    for (section, name), value in _VALUE_BEFORE_FIELD.items():
      if isinstance(raw.get(section, {}), Mapping):
        raw[section] = {name: value, **raw.get(section, {})}
  made = {}
  for key, fields in raw.items():
    if key not in SECTIONS or not isinstance(fields, Mapping):
      check(saved, f"{key} is not a config section; sections: {', '.join(SECTIONS)}")
      continue
    section = SECTIONS[key]
    known = {f.name for f in dataclasses.fields(section)}
    unknown = sorted(set(fields) - known)
    check(saved or not unknown,
          f"{key}.{unknown[0] if unknown else ''} is not a field of the {key} section")
    made[key] = section(**{k: v for k, v in fields.items() if k in known})
  return Config(**made)


def validate(config: ml_collections.ConfigDict | Mapping[str, Any] | Config) -> Config:
  """`parse`: raises ConfigError naming the first bad field; compiles and reads nothing."""
  return parse(config)


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
  c.data.update(train_split="train[:4000]", eval_split="validation[:256]",
                vocab_size=min(c.data.vocab_size, 500), max_len=min(c.data.max_len, 32),
                batch_size=16)
  c.eval.update(batch_size=64, bleu_sentences=64, every=10)
  lm = c.model.family in DOCUMENT_FAMILIES
  if lm:  # A corpus of a few dozen documents: all of them; the tokenizer fitted on a sample.
    c.data.update(train_split="train", eval_split="validation",
                  tokenizer_sample=min(c.data.tokenizer_sample, 20_000))
  encoder_only = c.model.family == "encoder_only"
  c.model.update(d_model=32, num_heads=4, ffn_dim=64,
                 num_encoder_layers=0 if c.model.family == "decoder_only" else 2,
                 num_decoder_layers=0 if encoder_only else 2)
  if lm:
    c.eval.bleu_sentences = 0
  c.optimizer.warmup_steps = 5
  c.run.update(num_steps=20, log_every=5, checkpoint_every=10)
  return c
