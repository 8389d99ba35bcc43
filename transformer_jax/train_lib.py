"""Train state, optimizer, loss, and the pure train and eval steps."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh

from transformer_jax import sharding

Batch = dict[str, jax.Array]


class TrainState(train_state.TrainState):
  rng: jax.Array  # Dropout key of step s is fold_in(rng, s).


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The config fields the optimizer uses (meanings in transformer_jax/config.py)."""
  schedule: str = "rsqrt"
  learning_rate: float = 7e-4
  warmup_steps: int = 4000
  num_steps: int = 10_000
  adam_b1: float = 0.9
  adam_b2: float = 0.98
  adam_eps: float = 1e-9
  weight_decay: float = 0.0
  grad_clip: float = 1.0


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """`rsqrt`: the paper's linear warmup then inverse square root decay, peaking at
  `learning_rate`; `cosine`: warmup then cosine decay to 0; `constant`."""
  peak, warmup = cfg.learning_rate, cfg.warmup_steps
  if cfg.schedule == "constant":
    return optax.constant_schedule(peak)
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, cfg.num_steps)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup),
       lambda s: peak * jnp.sqrt(warmup / jnp.maximum(s + warmup, 1.0))],  # s: steps after warmup.
      [warmup])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """Global-norm clipping then Adam(W) with the config's betas, epsilon and schedule."""
  decay_mask = lambda params: jax.tree.map(lambda p: jnp.ndim(p) > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2,
                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay, mask=decay_mask))


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                       mesh: Mesh, max_len: int) -> tuple[TrainState, Any]:
  """Initializes the state directly into its shardings; returns (state, state_shardings)."""
  dummy = jnp.ones((1, max_len), jnp.int32)

  def init(rng):  # Parameters still boxed with their logical axis names.
    params_rng, dropout_rng = jax.random.split(rng)
    params = model.init(params_rng, dummy, dummy)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_rng)

  # No mesh context here: out_shardings place the state, and flax's DenseGeneral would
  # otherwise constrain its flat [in, out] kernel with the 3-axis names of the reshaped one.
  abstract = jax.eval_shape(init, jax.random.PRNGKey(seed))
  shardings = sharding.logical_shardings(abstract, mesh)
  state = jax.jit(lambda rng: nn.meta.unbox(init(rng)),
                  out_shardings=shardings)(jax.random.PRNGKey(seed))
  return state, shardings


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
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  smoothed = (1.0 - label_smoothing) * nll + label_smoothing * (lse - logits.mean(axis=-1))
  return (smoothed, nll), (logits, targets, lse)


def _token_losses_bwd(label_smoothing, residuals, cotangents):
  logits, targets, lse = residuals
  g_smoothed, g_nll = cotangents  # [B, T] each
  probs = jnp.exp(logits - lse[..., None])
  on_target = jnp.arange(logits.shape[-1]) == targets[..., None]  # [B, T, V], fused away
  g_target = ((1.0 - label_smoothing) * g_smoothed + g_nll)[..., None]
  d_logits = ((g_smoothed + g_nll)[..., None] * probs - jnp.where(on_target, g_target, 0.0)
              - (label_smoothing / logits.shape[-1]) * g_smoothed[..., None])
  return d_logits, None


token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float = 0.0) -> dict[str, jax.Array]:
  """Sums of smoothed loss, plain negative log-likelihood and correct tokens over real tokens.

  Args:
    logits: [B, T, V] float32. targets: [B, T] int. weights: [B, T], 0 on padding.
  """
  smoothed, nll = token_losses(logits, targets, label_smoothing)
  weights = weights.astype(jnp.float32)
  return {
      "loss_sum": jnp.sum(smoothed * weights),
      "nll_sum": jnp.sum(nll * weights),
      "correct": jnp.sum((jnp.argmax(logits, -1) == targets) * weights),
      "tokens": jnp.sum(weights),
  }


def _apply(apply_fn, params, batch: Batch, deterministic: bool, rngs=None):
  return apply_fn({"params": params}, batch["inputs"], batch["decoder_inputs"],
                  src_segments=batch["inputs_segment_ids"],
                  tgt_segments=batch["targets_segment_ids"],
                  src_positions=batch["inputs_positions"],
                  tgt_positions=batch["targets_positions"],
                  deterministic=deterministic, rngs=rngs)


def train_step(state: TrainState, batch: Batch, label_smoothing: float):
  """One optimizer step on the mean smoothed loss per real target token."""
  dropout_rng = jax.random.fold_in(state.rng, state.step)

  def loss_fn(params):
    logits = _apply(state.apply_fn, params, batch, False, {"dropout": dropout_rng})
    sums = cross_entropy(logits, batch["targets"], batch["targets_segment_ids"] > 0,
                         label_smoothing)
    return sums["loss_sum"] / jnp.maximum(sums["tokens"], 1.0), sums

  (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "nll": sums["nll_sum"] / jnp.maximum(sums["tokens"], 1.0),
             "grad_norm": optax.global_norm(grads), "tokens": sums["tokens"]}
  return state.apply_gradients(grads=grads), metrics


def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
  """Sums over the batch (combine across batches, then divide)."""
  logits = _apply(state.apply_fn, state.params, batch, True)
  return cross_entropy(logits, batch["targets"], batch["targets_segment_ids"] > 0)


def jit_steps(state_shardings, mesh: Mesh, label_smoothing: float):
  """train_step and eval_step jitted once with shardings; the train state is donated."""
  batch_sh, rep = sharding.batch_sharding(mesh), sharding.replicated(mesh)
  p_train = jax.jit(functools.partial(train_step, label_smoothing=label_smoothing),
                    in_shardings=(state_shardings, batch_sh), out_shardings=(state_shardings, rep),
                    donate_argnums=0)
  p_eval = jax.jit(eval_step, in_shardings=(state_shardings, batch_sh), out_shardings=rep)
  return p_train, p_eval


def summarize_eval(sums: list[dict[str, Any]]) -> dict[str, float]:
  """Per-token loss (plain cross-entropy), accuracy and perplexity from eval_step sums."""
  total = {k: float(np.sum([s[k] for s in sums])) for k in sums[0]}
  loss = total["nll_sum"] / max(total["tokens"], 1.0)
  return {"loss": loss, "accuracy": total["correct"] / max(total["tokens"], 1.0),
          "perplexity": float(np.exp(min(loss, 50.0)))}
