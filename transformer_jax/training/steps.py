"""Train state, optimizer, loss, and the pure train and eval steps."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax.training import train_state
from jax.sharding import Mesh

from transformer_jax import sharding
from transformer_jax.config import OptimizerConfig, StepConfig
from transformer_jax.data.tokenizer import UNK, word_marks
from transformer_jax.models import build
from transformer_jax.errors import UserError

Batch = dict[str, jax.Array]


class TrainState(train_state.TrainState):
  rng: jax.Array  # Dropout key of step s is fold_in(rng, s).
  ema_params: Any = None  # The parameters' exponential moving average; None where not kept.

  def eval_params(self):
    """The parameters evaluation and decoding use: the moving average where one is kept."""
    return self.params if self.ema_params is None else self.ema_params


def learning_rate_schedule(cfg: OptimizerConfig, num_steps: int) -> optax.Schedule:
  """`rsqrt`: the paper's linear warmup then inverse square root decay, peaking at
  `learning_rate`; `cosine`: warmup then cosine decay to 0 at `num_steps`; `wsd`: warmup, the
  peak, then a linear decay to 0 over the last `decay_fraction` of `num_steps`; `constant`
  (after schedule-free's warmup)."""
  peak, warmup = cfg.learning_rate, cfg.warmup_steps
  if cfg.schedule == "constant":
    if cfg.name == "schedule_free_adamw":
      return optax.warmup_constant_schedule(0.0, peak, max(warmup, 1))
    return optax.constant_schedule(peak)
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(num_steps, warmup + 1))
  if cfg.schedule == "wsd":
    decay = max(1, round(cfg.decay_fraction * num_steps))
    stable = max(num_steps - decay - warmup, 0)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak),
         optax.linear_schedule(peak, 0.0, decay)], [warmup, warmup + stable])
  if warmup == 0:
    return lambda s: peak * jax.lax.rsqrt(s + 1.0)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup),
       lambda s: peak * jnp.sqrt(warmup / jnp.maximum(s + warmup, 1.0))],  # s: steps after warmup.
      [warmup])


def muon_dimensions(boxed_params):
  """Muon's view of each parameter, from its logical axis names: a block's matrix (embed and
  names only of mlp, heads and kv; a scanned stack's "layers" axis is a batch axis) as the product
  it computes, contracting its input axes (the leading "embed", or all but the trailing
  "embed") into its output ones; None (Adam) for the rest: embeddings and the vocabulary
  projection, positions, norms, biases, a classifier's head."""
  matrix = {"embed", "mlp", "heads", "kv"}

  def dims(box):
    names = tuple(n for n in box.names if n != "layers")
    if len(names) < 2 or not set(names) <= matrix or "embed" not in names:  # A bias [N, H].
      return None
    offset = len(box.names) - len(names)  # "layers" leads a scanned stack.
    if names[0] == "embed":
      inputs = (0,)
    else:
      inputs = tuple(range(len(names) - 1))
    outputs = tuple(i for i in range(len(names)) if i not in inputs)
    return optax.contrib.MuonDimensionNumbers(tuple(offset + i for i in inputs),
                                              tuple(offset + i for i in outputs))
  return jax.tree.map(dims, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def make_optimizer(cfg: OptimizerConfig, num_steps: int,
                   model: nn.Module | None = None) -> optax.GradientTransformation:
  """Global-norm clipping (none where grad_clip is 0) then the config's optimizer over a run of
  `num_steps`: AdamW, Muon (which reads `model`'s parameter names to pick its matrices) or
  schedule-free AdamW. Weight decay falls on matrices only."""
  decay_mask = lambda params: jax.tree.map(lambda p: jnp.ndim(p) > 1, params)
  lr = learning_rate_schedule(cfg, num_steps)
  if cfg.name == "muon":
    if model is None:
      raise ValueError("Muon picks its matrices by the model's parameter names: pass `model`")
    scale = cfg.muon_lr_scale
    update = optax.contrib.muon(
        (lambda s: scale * lr(s)) if scale != 1.0 else lr, beta=cfg.muon_beta,
        eps=cfg.adam_eps, weight_decay=cfg.weight_decay, adam_b1=cfg.adam_b1,
        adam_b2=cfg.adam_b2, adam_learning_rate=lr, consistent_rms=0.2,
        muon_weight_dimension_numbers=muon_dimensions(build.abstract_params(model)))
  elif cfg.name == "schedule_free_adamw":
    # optax's schedule_free_adamw, with the weight decay masked as AdamW's.
    update = optax.contrib.schedule_free(
        optax.chain(optax.scale_by_rms(cfg.adam_b2, cfg.adam_eps, eps_in_sqrt=False,
                                       bias_correction=True),
                    optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                    optax.scale_by_learning_rate(lr)),
        learning_rate=lr, b1=cfg.adam_b1)
  else:
    update = optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                         weight_decay=cfg.weight_decay, mask=decay_mask)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity(), update)


def schedule_free_state(opt_state):
  """The ScheduleFreeState inside an optimizer state, None where it has none."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.contrib.ScheduleFreeState))
      if isinstance(s, optax.contrib.ScheduleFreeState)]
  return found[0] if found else None


def _init_fn(model: nn.Module, tx: optax.GradientTransformation, max_len: int, ema: bool):
  """rng -> a new TrainState, its parameters still boxed with their logical axis names."""
  dummy = jnp.ones((1, max_len), jnp.int32)
  inputs = (dummy, dummy) if model.cfg.family == "encoder_decoder" else (dummy,)

  def init(rng):
    params_rng, dropout_rng = jax.random.split(rng)
    params = model.init(params_rng, *inputs)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_rng,
                             ema_params=params if ema else None)
  return init


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                         max_len: int, ema: bool = False) -> tuple[TrainState, Any]:
  """(state of jax.ShapeDtypeStructs carrying their shardings, state_shardings): the train
  state's shapes and placement over `mesh`, with nothing allocated or run. The mesh's devices
  may be compile-only ones (a TPU topology named on a host without TPUs)."""
  boxed = jax.eval_shape(_init_fn(model, tx, max_len, ema), jax.random.PRNGKey(0))
  shardings = sharding.logical_shardings(boxed, mesh)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nn.meta.unbox(boxed), shardings)
  return abstract, shardings


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                       mesh: Mesh, max_len: int, ema: bool = False) -> tuple[TrainState, Any]:
  """Initializes the state directly into its shardings; returns (state, state_shardings).
  `ema`: the state keeps a moving average of the parameters (starting from them)."""
  _, shardings = abstract_train_state(model, tx, mesh, max_len, ema)
  init = _init_fn(model, tx, max_len, ema)
  # No mesh context here: out_shardings place the state, and flax's DenseGeneral would
  # otherwise constrain its flat [in, out] kernel with the 3-axis names of the reshaped one.
  state = jax.jit(lambda rng: nn.meta.unbox(init(rng)),
                  out_shardings=shardings)(jax.random.PRNGKey(seed))
  return state, shardings


def ema_decay_at(decay: float, step: jax.Array) -> jax.Array:
  """The moving average's decay at the update that makes step `step` + 1: `decay`, but at most
  (1 + step) / (10 + step), so that the first updates are not dominated by the initialization."""
  step = jnp.asarray(step, jnp.float32)
  return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float):
  """Per-token smoothed loss and negative log-likelihood, [B, T] each, from integer labels.

  The smoothed loss is the cross-entropy against (1 - label_smoothing) on the target plus
  label_smoothing spread uniformly over the vocabulary; no [B, T, V] one-hot or log-probability
  array is built. The custom backward pass writes the logits gradient, softmax minus the
  smoothed target, in one elementwise pass over [B, T, V].
  """
  return _token_losses_fwd(logits, targets, label_smoothing)[0]


def _token_losses_fwd(logits, targets, label_smoothing):
  # The residual is the logits as given (bfloat16 in a bfloat16 model: half the bytes of a
  # float32 copy); the backward pass upcasts them again, exactly, as here.
  x = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(x, axis=-1)  # [B, T]
  nll = lse - jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
  smoothed = (1.0 - label_smoothing) * nll + label_smoothing * (lse - x.mean(axis=-1))
  return (smoothed, nll), (logits, targets, lse)


def _token_losses_bwd(label_smoothing, residuals, cotangents):
  logits, targets, lse = residuals
  g_smoothed, g_nll = cotangents  # [B, T] each
  dtype, logits = logits.dtype, logits.astype(jnp.float32)
  probs = jnp.exp(logits - lse[..., None])
  on_target = jnp.arange(logits.shape[-1]) == targets[..., None]  # [B, T, V], fused away
  g_target = ((1.0 - label_smoothing) * g_smoothed + g_nll)[..., None]
  d_logits = ((g_smoothed + g_nll)[..., None] * probs - jnp.where(on_target, g_target, 0.0)
              - (label_smoothing / logits.shape[-1]) * g_smoothed[..., None])
  return d_logits.astype(dtype), None


token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float = 0.0) -> dict[str, jax.Array]:
  """Sums of smoothed loss, plain negative log-likelihood and correct tokens over real tokens.

  Args:
    logits: [B, T, V] (any float dtype; the sums are float32). targets: [B, T] int.
      weights: [B, T], 0 on padding.
  """
  smoothed, nll = token_losses(logits, targets, label_smoothing)
  weights = weights.astype(jnp.float32)
  return {
      "loss_sum": jnp.sum(smoothed * weights),
      "nll_sum": jnp.sum(nll * weights),
      "correct": jnp.sum((jnp.argmax(logits, -1) == targets) * weights),
      "tokens": jnp.sum(weights),
  }


def _apply(apply_fn, params, batch: Batch, deterministic: bool, rngs=None, method=None):
  if "masked_inputs" in batch:  # A masked language model's (`with_masks`).
    return apply_fn({"params": params}, batch["masked_inputs"], batch["targets_segment_ids"],
                    batch["targets_positions"], deterministic=deterministic, rngs=rngs,
                    method=method)
  if "inputs" not in batch:  # A language model's batch (packing.LM_FEATURES).
    return apply_fn({"params": params}, batch["decoder_inputs"], batch["targets_segment_ids"],
                    batch["targets_positions"], deterministic=deterministic, rngs=rngs,
                    method=method)
  return apply_fn({"params": params}, batch["inputs"], batch["decoder_inputs"],
                  src_segments=batch["inputs_segment_ids"],
                  tgt_segments=batch["targets_segment_ids"],
                  src_positions=batch["inputs_positions"],
                  tgt_positions=batch["targets_positions"],
                  deterministic=deterministic, rngs=rngs, method=method)


_SUMS = ("loss_sum", "nll_sum", "correct", "tokens")


def loss_weights(batch: Batch) -> jax.Array:
  """[B, T] bool: the target tokens the loss counts: every real one, or a masked language
  model's masked ones; [B, 1] for a classifier's batch: its rows that hold a text."""
  if "labels" in batch:
    return batch["targets_segment_ids"][:, :1] > 0
  if "masked" in batch:
    return batch["masked"]
  return batch["targets_segment_ids"] > 0


@dataclasses.dataclass(frozen=True)
class Masking:
  """Masked language modelling's rule. BERT's (`words` empty): each real token but <bos>/<eos>
  is chosen with probability `rate`. Whole words (`words` given): each word, a run of pieces
  with a letter or digit that starts after a space or a piece without one, is chosen with
  probability `rate`, all its pieces together; pieces of only spaces, newlines or punctuation
  are never chosen. A chosen token is read as `mask_id` (80%), a random piece (10%) or itself
  (10%), and predicted."""
  mask_id: int
  vocab_size: int  # The tokenizer's pieces: random replacements are drawn from [UNK, vocab).
  rate: float = 0.15
  # Whole words: per id, bit 0 set where the piece holds a letter or digit, bit 1 where its
  # text begins with a space (data/tokenizer.py word_marks); b"": BERT's pieces.
  words: bytes = b""


def masking_rule(vocab_size: int, step: StepConfig = StepConfig(), tokenizer=None) -> Masking:
  """A masked language model's masking rule (tasks.Task.masking: which runs draw one) as
  `step.masking` and `step.mask_rate` say, its tokenizer having `vocab_size` pieces (the mask id
  is the next: build.mask_id). Whole words read the `tokenizer`'s pieces; without one (a program
  compiled, never run) every piece is a word."""
  words = b""
  if step.masking == "words":
    marks = word_marks(tokenizer) if tokenizer is not None else [1] * vocab_size
    words = bytes(marks)
  return Masking(mask_id=build.mask_id(vocab_size), vocab_size=vocab_size, rate=step.mask_rate,
                 words=words)


MASK_STREAM = 0x6D6C6D  # Folded into the train state's key: masking's keys, apart from dropout's.


def mask_key(rng: jax.Array, step) -> jax.Array:
  """The key of the masks of the step that `step` counts (before its update), from the train
  state's key `rng`: apart from dropout's, and the same for a resumed run."""
  return jax.random.fold_in(jax.random.fold_in(rng, MASK_STREAM), step)


def with_masks(batch: Batch, key: jax.Array, masking: Masking) -> Batch:
  """The batch with `masked_inputs` (the tokens as the model reads them) and `masked` (the
  positions it predicts), drawn for row r from fold_in(key, r): a row's masks depend on the key
  and its index only."""
  tokens, segments = batch["targets"], batch["targets_segment_ids"]
  eligible = (segments > 0) & (tokens >= UNK)
  if masking.words:
    marks = jnp.asarray(np.frombuffer(masking.words, np.uint8))[tokens]  # [B, T]
    eligible = eligible & (marks & 1 > 0)
    # A word starts at a piece with a letter after a space, a piece without one, or a new
    # segment; its later pieces share its draw.
    before = jnp.pad(eligible, ((0, 0), (1, 0)))[:, :-1]
    same_segment = segments == jnp.pad(segments, ((0, 0), (1, 0)))[:, :-1]
    starts = eligible & ((marks & 2 > 0) | ~before | ~same_segment)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    word_of = jax.lax.cummax(jnp.where(starts, positions, 0), axis=1)  # [B, T]: its start.

  def row(r, tokens, eligible, word_of):
    k_choose, k_how, k_random = jax.random.split(jax.random.fold_in(key, r), 3)
    draw = jax.random.uniform(k_choose, tokens.shape)
    if masking.words:
      draw = draw[word_of]  # Every piece of a word takes its first piece's draw.
    chosen = eligible & (draw < masking.rate)
    how = jax.random.uniform(k_how, tokens.shape)
    random_ids = jax.random.randint(k_random, tokens.shape, UNK, masking.vocab_size,
                                    dtype=tokens.dtype)
    read = jnp.where(how < 0.8, masking.mask_id, jnp.where(how < 0.9, random_ids, tokens))
    return jnp.where(chosen, read, tokens), chosen

  if not masking.words:
    word_of = jnp.zeros_like(tokens)  # Unread.
  masked_inputs, masked = jax.vmap(row)(jnp.arange(tokens.shape[0]), tokens, eligible, word_of)
  return {**batch, "masked_inputs": masked_inputs, "masked": masked}


def masked_once(batches: list, masking: Masking, seed: int) -> list:
  """A masked language model's evaluation batches with their masks drawn once, batch i's from
  fold_in(key(seed), i) (and this host's index): every evaluation reads the same."""
  draw = jax.jit(with_masks, static_argnums=2)
  key = jax.random.fold_in(jax.random.PRNGKey(seed), jax.process_index())
  return [jax.device_get(draw(batch, jax.random.fold_in(key, i), masking))
          for i, batch in enumerate(batches)]


def loss_sums(apply_fn, params, batch: Batch, label_smoothing: float = 0.0, loss_chunks: int = 1,
              deterministic: bool = True, rngs=None,
              predict_at_most: int = 0) -> dict[str, jax.Array]:
  """cross_entropy's sums over a batch (a classifier's batch, with `labels` [B]: over its rows);
  with `loss_chunks` > 1 through projected_loss (the [B, T, V] logits never whole; only
  `loss_sum` is differentiable then). A masked language model's batch with `predict_at_most`
  > 0: the logits of its masked positions only (at_masked)."""
  weights = loss_weights(batch)
  if "labels" in batch:  # A classifier's: one prediction a row, [B, 1, labels].
    logits = _apply(apply_fn, params, batch, deterministic, rngs)
    return cross_entropy(logits[:, None], batch["labels"][:, None], weights, label_smoothing)
  targets = batch["targets"]
  if loss_chunks == 1:
    features = _apply(apply_fn, params, batch, deterministic, rngs, method="features")
    logits_of = lambda f: apply_fn({"params": params}, f, method="logits")  # Compute dtype.
    if predict_at_most and "masked" in batch:
      return at_masked(logits_of, features, targets, weights, label_smoothing, predict_at_most)
    return cross_entropy(logits_of(features), targets, weights, label_smoothing)
  features = _apply(apply_fn, params, batch, deterministic, rngs, method="features")
  kernel, bias = apply_fn({"params": params}, method="output_weights")
  loss_sum, stats = projected_loss(features, kernel, bias, targets,
                                   weights.astype(jnp.float32), label_smoothing, loss_chunks)
  return {"loss_sum": loss_sum, **jax.lax.stop_gradient(stats)}


def at_masked(logits_of, features, targets, weights, label_smoothing: float, budget: int):
  """cross_entropy's sums over the masked positions (`weights` [B, T] bool) of a masked language
  model's batch, their features gathered into `budget` rows first: the logits of the other
  positions, which the loss weighs 0, are never computed (nor their softmax, nor their
  gradient). Where more than `budget` positions are masked, every position's logits, as
  without it. The same sums up to float32's order of summation."""
  features, targets, weights = map(jnp.asarray, (features, targets, weights))
  flat, count = weights.reshape(-1), jnp.sum(weights)

  def gathered():
    rows = jnp.nonzero(flat, size=budget, fill_value=0)[0]
    real = jnp.arange(budget) < count  # The rows past the count repeat row 0, weighed 0.
    picked = features.reshape(-1, features.shape[-1])[rows][None]  # [1, budget, D]
    return cross_entropy(logits_of(picked), targets.reshape(-1)[rows][None], real[None],
                         label_smoothing)

  def whole():
    return cross_entropy(logits_of(features), targets, weights, label_smoothing)
  return jax.lax.cond(count <= budget, gathered, whole)


def prediction_budget(shape: tuple[int, int], masking: Masking) -> int:
  """The rows at_masked gathers for a [B, T] batch masked by `masking`: twice the share its
  rate masks, rounded up to 128 (more is all but impossible, and then at_masked computes every
  position's logits)."""
  tokens = shape[0] * shape[1]
  return min(tokens, -(-int(np.ceil(2 * masking.rate * tokens)) // 128) * 128)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def projected_loss(features, kernel, bias, targets, weights, label_smoothing: float,
                   chunks: int):
  """The vocabulary projection and the smoothed loss fused, `chunks` slices of the length at a
  time: (loss_sum, {nll_sum, correct, tokens}) as cross_entropy(features @ kernel + bias, ...)
  gives them, up to the order of float additions.

  Each slice's gradient is formed in the forward pass, right after its loss (the loss is the
  last thing computed, so its gradient is the cotangent times that), and its logits are dropped:
  only one [B, T / chunks, V] slice of logits exists at a time, nothing is recomputed, and the
  backward pass only scales the saved gradients. Only `loss_sum` is differentiable: the
  statistics' cotangents are ignored (loss_sums stops their gradients).

  Args:
    features: [B, T, D] decoder output. kernel: [D, V], bias: [V] or None, in the compute
      dtype. targets: [B, T] int. weights: [B, T] float32, 0 on padding.
  """
  return _projected_loss_fwd(features, kernel, bias, targets, weights, label_smoothing,
                             chunks)[0]


def _projected_loss_fwd(features, kernel, bias, targets, weights, label_smoothing, chunks):
  rows, length, _ = features.shape
  if length % chunks:
    raise ValueError(f"loss_chunks={chunks} does not divide the target length {length}")

  def slices(x):  # [B, T, ...] -> [chunks, B, T / chunks, ...]
    return jnp.moveaxis(x.reshape(rows, chunks, length // chunks, *x.shape[2:]), 1, 0)

  def one_slice(carry, xs):
    d_kernel, d_bias, sums = carry
    y, t, w = xs
    z = jnp.einsum("btd,dv->btv", y, kernel)  # [B, T / chunks, V]
    logits = nn.with_logical_constraint(z if bias is None else z + bias,
                                        ("batch", "length", "vocab")).astype(jnp.float32)
    (smoothed, nll), residuals = _token_losses_fwd(logits, t, label_smoothing)
    # d loss_sum / d logits: the weight of each token on the smoothed loss, none on the nll.
    g = _token_losses_bwd(label_smoothing, residuals, (w, jnp.zeros_like(w)))[0].astype(y.dtype)
    d_kernel = d_kernel + jnp.einsum("btd,btv->dv", y, g, preferred_element_type=jnp.float32)
    if bias is not None:
      d_bias = d_bias + jnp.sum(g, axis=(0, 1), dtype=jnp.float32)
    sums = {"loss_sum": sums["loss_sum"] + jnp.sum(smoothed * w),
            "nll_sum": sums["nll_sum"] + jnp.sum(nll * w),
            "correct": sums["correct"] + jnp.sum((jnp.argmax(logits, -1) == t) * w),
            "tokens": sums["tokens"] + jnp.sum(w)}
    return (d_kernel, d_bias, sums), jnp.einsum("btv,dv->btd", g, kernel)

  zeros = (jnp.zeros(kernel.shape, jnp.float32),
           None if bias is None else jnp.zeros(bias.shape, jnp.float32),
           {k: jnp.zeros((), jnp.float32) for k in _SUMS})
  (d_kernel, d_bias, sums), d_features = jax.lax.scan(
      one_slice, zeros, (slices(features), slices(targets), slices(weights)))
  d_features = jnp.moveaxis(d_features, 0, 1).reshape(features.shape)
  loss_sum = sums.pop("loss_sum")
  return (loss_sum, sums), (d_features, d_kernel.astype(kernel.dtype),
                            None if bias is None else d_bias.astype(bias.dtype))


def _projected_loss_bwd(label_smoothing, chunks, residuals, cotangents):
  d_features, d_kernel, d_bias = residuals
  g = cotangents[0]  # Of loss_sum; the statistics' are ignored (see projected_loss).
  scale = lambda x: None if x is None else (g * x).astype(x.dtype)
  return scale(d_features), scale(d_kernel), scale(d_bias), None, None


projected_loss.defvjp(_projected_loss_fwd, _projected_loss_bwd)


def microbatches(batch: Batch, k: int) -> Batch:
  """[B, ...] arrays -> [k, B / k, ...]; microbatch j holds rows j, j + k, j + 2k, ..., so that
  rows sharded in contiguous blocks over the data axes stay on their devices."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1),
                      batch)


def train_step(state: TrainState, batch: Batch, cfg: StepConfig = StepConfig(),
               masking: Masking | None = None):
  """One optimizer step on the mean smoothed loss per real target token of the batch.

  With `cfg.grad_accum_steps` = k > 1 the batch is cut into k microbatches whose gradients are
  summed in a `lax.scan` before the one update: the same update as the whole batch at once (up
  to the order of additions; each microbatch draws its own dropout masks), with the activations
  of one microbatch in memory.

  A step whose loss or gradient norm is not finite changes nothing but the step count: its
  update is dropped on the device, and `metrics["nonfinite"]` is 1 (the host reads it when it
  logs; see NonFiniteGuard). With `cfg.ema_decay` > 0 the state's `ema_params` follow the new
  parameters: ema <- d * ema + (1 - d) * params, d = ema_decay_at(ema_decay, step).
  `cfg.nan_at_step` > 0 makes that step's loss and gradients NaN (a
  fault injected by tests). `masking`: a masked language model's step, its masks drawn from
  the train state's key and step (a resumed run masks as an uninterrupted one).
  """
  dropout_rng = jax.random.fold_in(state.rng, state.step)
  if masking is not None:
    batch = with_masks(batch, mask_key(state.rng, state.step), masking)
  # The loss is a mean over the whole batch's target tokens, whichever microbatch they are in.
  tokens = jnp.maximum(jnp.sum(loss_weights(batch)).astype(jnp.float32), 1.0)

  def mean_loss(sums):
    loss = sums["loss_sum"] / tokens
    if cfg.nan_at_step:
      loss = loss * jnp.where(state.step + 1 == cfg.nan_at_step, jnp.nan, 1.0)
    return loss

  def loss_fn(params, batch, rng):
    budget = prediction_budget(batch["targets"].shape, masking) if masking else 0
    sums = loss_sums(state.apply_fn, params, batch, cfg.label_smoothing, cfg.loss_chunks, False,
                     {"dropout": rng}, predict_at_most=budget)
    return mean_loss(sums), sums

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  k = cfg.grad_accum_steps
  if k == 1:
    (loss, sums), grads = grad_fn(state.params, batch, dropout_rng)
  else:
    def add_microbatch(total, xs):
      micro, j = xs
      (_, sums), grads = grad_fn(state.params, micro, jax.random.fold_in(dropout_rng, j))
      return jax.tree.map(jnp.add, total, (grads, sums)), None

    zeros = (jax.tree.map(jnp.zeros_like, state.params),
             {name: jnp.zeros((), jnp.float32) for name in _SUMS})
    (grads, sums), _ = jax.lax.scan(add_microbatch, zeros,
                                    (microbatches(batch, k), jnp.arange(k)))
    loss = mean_loss(sums)
  with jax.named_scope("optimizer"):  # Its ops' names say so in a profile.
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = state.apply_gradients(grads=grads)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = new_state.replace(params=keep(new_state.params, state.params),
                                  opt_state=keep(new_state.opt_state, state.opt_state))
  if (free := schedule_free_state(new_state.opt_state)) is not None:
    # Schedule-free's evaluation point, kept beside the point its gradients are taken at.
    evaluated = optax.contrib.schedule_free_eval_params(free, new_state.params)
    new_state = new_state.replace(ema_params=keep(evaluated, state.ema_params))
  elif cfg.ema_decay:
    if state.ema_params is None:
      raise ValueError("ema_decay > 0 needs a train state that keeps a moving average "
                       "(create_train_state(..., ema=True))")
    d = ema_decay_at(cfg.ema_decay, state.step)
    ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * p, state.ema_params, new_state.params)
    new_state = new_state.replace(ema_params=keep(ema, state.ema_params))
  metrics = {"loss": loss, "nll": sums["nll_sum"] / tokens, "grad_norm": grad_norm,
             # The batch's real tokens (throughput, padding), whatever the loss counts.
             "tokens": jnp.sum(batch["targets_segment_ids"] > 0).astype(jnp.float32),
             "nonfinite": 1.0 - finite.astype(jnp.float32)}
  if masking is not None:
    metrics["masked_tokens"] = sums["tokens"]
  if "labels" in batch:
    metrics["examples"] = sums["tokens"]
  return new_state, metrics


class NonFiniteError(UserError, RuntimeError):
  """Training met non-finite losses it was told not to go on with."""


class NonFiniteGuard:
  """The host side of train_step's non-finite flag, read only where the loop syncs anyway (log
  steps, checkpoints).

  `stop`: the first flagged step raises NonFiniteError naming it. `skip`: flagged steps are
  counted (their updates were dropped on the device); `max_in_row` of them in a row raise.
  """

  def __init__(self, mode: str, max_in_row: int):
    self.mode, self.max_in_row = mode, max_in_row
    self.pending: list[tuple[int, jax.Array]] = []
    self.skipped = self.in_row = 0

  def record(self, step: int, nonfinite: jax.Array) -> None:
    self.pending.append((step, nonfinite))

  def check(self) -> None:
    pending, self.pending = self.pending, []
    for step, flag in pending:
      if not float(flag):
        self.in_row = 0
        continue
      if self.mode == "stop":
        raise NonFiniteError(
            f"non-finite loss or gradients at step {step} (its update was dropped; nothing "
            "after the last checkpoint is saved). Lower learning_rate, or set "
            "nonfinite='skip' to skip such steps")
      self.skipped += 1
      self.in_row += 1
      logging.warning("Step %d: non-finite loss or gradients, update skipped (%d so far)", step,
                      self.skipped)
      if self.in_row >= self.max_in_row:
        raise NonFiniteError(f"{self.in_row} non-finite steps in a row, the last at step {step} "
                             f"(max_nonfinite_in_row={self.max_in_row})")


@jax.jit
def all_finite(tree) -> jax.Array:
  """Whether every floating-point value in `tree` is finite (one device scalar)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def eval_step(state: TrainState, batch: Batch, loss_chunks: int = 1) -> dict[str, jax.Array]:
  """Sums over the batch (combine across batches, then divide), with the evaluation parameters
  (the moving average where one is kept)."""
  return loss_sums(state.apply_fn, state.eval_params(), batch, loss_chunks=loss_chunks)


def jit_steps(state_shardings, mesh: Mesh, cfg: StepConfig, masking: Masking | None = None):
  """train_step and eval_step jitted once with shardings; the train state is donated."""
  batch_sh, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  p_train = jax.jit(functools.partial(train_step, cfg=cfg, masking=masking),
                    in_shardings=(state_shardings, batch_sh), out_shardings=(state_shardings, rep),
                    donate_argnums=0)
  p_eval = jax.jit(functools.partial(eval_step, loss_chunks=cfg.loss_chunks),
                   in_shardings=(state_shardings, batch_sh), out_shardings=rep)
  return p_train, p_eval


def summarize_eval(sums: list[dict[str, Any]],
                   per_char: dict[str, float] | None = None) -> dict[str, float]:
  """Per-token loss (plain cross-entropy), accuracy and perplexity from eval_step sums; with
  `per_char` ({"characters", "unigram_bits"} of the evaluated text) also the loss in bits per
  character, and a unigram model's beside it."""
  total = {k: float(np.sum([s[k] for s in sums])) for k in sums[0]}
  loss = total["nll_sum"] / max(total["tokens"], 1.0)
  result = {"loss": loss, "accuracy": total["correct"] / max(total["tokens"], 1.0),
            "perplexity": float(np.exp(min(loss, 50.0)))}
  if per_char:
    result["bits_per_char"] = total["nll_sum"] / np.log(2) / per_char["characters"]
    result["unigram_bits_per_char"] = per_char["unigram_bits"] / per_char["characters"]
  return result
