"""Embedding lookups whose table gradient is formed without a contended scatter-add.

The lookup `table[ids]` is a gather; autodiff makes its gradient a scatter-add of the output
gradient's rows into a [V, D] table. On NVIDIA GPUs XLA adds with atomics, and rows that hit
the same id collide: on real text (Zipf-distributed ids, a padding id repeated) the base train
step ran at half the speed it reaches on uniform random ids (openxla/xla#46225,
openxla/xla#26371). TPUs serialise scatters too. `model.embed_grad` picks how the table's
gradient is formed:

  scatter  autodiff's scatter-add (the fastest on CPUs, where nothing contends).
  onehot   a matrix product one_hot(ids)^T [V, N] x g [N, D], accumulated in float32: no
           scatter, 2 N V D FLOPs on the matrix units (the usual choice on TPUs).
  sorted   the ids sorted, a segmented sum over each run of equal ids, and each id's sum read
           at the end of its run: a sort, gathers and an O(N log N) scan of [N, D] elementwise
           work, no scatter and no atomics (for GPUs).
  auto     `onehot` on TPUs, `sorted` on GPUs, `scatter` elsewhere.

Both replacements accumulate in float32 whatever the compute dtype (autodiff's scatter-add of
a bfloat16 lookup adds in bfloat16), and run the forward lookup exactly as autodiff's does.

Shapes: N tokens (the lookup's ids flattened), V vocabulary, D model dim, S data shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

GRAD_IMPLS = ("scatter", "onehot", "sorted")
_AUTO = {"tpu": "onehot", "gpu": "sorted", "cuda": "sorted", "rocm": "sorted"}


def grad_impl(requested: str, platform: str | None = None) -> str:
  """`auto` resolved for `platform` ("gpu", "tpu", "cpu"; default: this process's backend)."""
  if requested != "auto":
    return requested
  return _AUTO.get(platform or jax.default_backend(), "scatter")


def lookup(table: jax.Array, ids: jax.Array, dtype, impl: str, shards: int = 1) -> jax.Array:
  """table: [V, D] (the parameter), ids: [...] int -> [..., D] rows of the table in `dtype`.

  `impl`: one of GRAD_IMPLS (how the table's gradient is formed), or `auto` for this
  process's backend; `shards`: for `sorted`, the data-parallel devices the ids are split over,
  each of which sorts its own share (the sum over shards is then one all-reduce, as for a
  scatter's partial tables).
  """
  impl = grad_impl(impl)
  if impl == "scatter":
    return jnp.take(table.astype(dtype), ids, axis=0)  # What nn.Embed does.
  if impl not in GRAD_IMPLS:
    raise ValueError(f"embedding gradient {impl!r} is not one of {GRAD_IMPLS}")
  return _lookup(table, ids, jnp.dtype(dtype), impl, shards)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _lookup(table, ids, dtype, impl, shards):
  return jnp.take(table.astype(dtype), ids, axis=0)


def _lookup_fwd(table, ids, dtype, impl, shards):
  # The table is a parameter, alive through the step anyway: keeping it costs nothing.
  return _lookup(table, ids, dtype, impl, shards), (table, ids)


def _lookup_bwd(dtype, impl, shards, residuals, g):
  table, ids = residuals
  vocab = table.shape[0]
  ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])  # [..., D] -> [N, D]
  if impl == "onehot":
    d_table = onehot_sum(ids, g, vocab)
  else:
    d_table = sorted_sum(ids, g, vocab, shards)
  return d_table.astype(table.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def onehot_sum(ids: jax.Array, g: jax.Array, vocab: int) -> jax.Array:
  """ids: [N], g: [N, D] -> [V, D] float32, row v the sum of g's rows where ids == v, as one
  matrix product. A float32 g is multiplied at full precision (no TF32 or one-pass bfloat16);
  the one-hot side is exact in any dtype."""
  one_hot = jax.nn.one_hot(ids, vocab, dtype=g.dtype)  # [N, V]
  precision = lax.Precision.HIGHEST if g.dtype == jnp.float32 else None
  return jnp.einsum("nv,nd->vd", one_hot, g, precision=precision,
                    preferred_element_type=jnp.float32)


def sorted_sum(ids: jax.Array, g: jax.Array, vocab: int, shards: int = 1) -> jax.Array:
  """`onehot_sum`'s result by sorting: ids [N], g [N, D] -> [V, D] float32.

  With `shards` > 1 (dividing N) each contiguous share of N is summed on its own and the
  shares' tables added: a data-parallel device sorts only the tokens it holds.
  """
  if shards > 1 and ids.shape[0] % shards == 0:
    per_shard = jax.vmap(_sorted_sum, in_axes=(0, 0, None))(
        ids.reshape(shards, -1), g.reshape(shards, -1, g.shape[-1]), vocab)  # [S, V, D]
    return per_shard.sum(axis=0)
  return _sorted_sum(ids, g, vocab)


def _sorted_sum(ids, g, vocab):
  n = ids.shape[0]
  sorted_ids, order = lax.sort_key_val(ids, jnp.arange(n, dtype=ids.dtype))  # [N], [N]
  rows = jnp.take(g, order, axis=0).astype(jnp.float32)  # [N, D] in id order
  starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])  # [N]

  def add_within_runs(a, b):  # (run starts here, running sum), a before b.
    a_start, a_sum = a
    b_start, b_sum = b
    return a_start | b_start, jnp.where(b_start[..., None], b_sum, a_sum + b_sum)

  _, sums = lax.associative_scan(add_within_runs, (starts, rows))  # [N, D]
  # The last position of each id's run: one past it is where the next id would be inserted.
  vocab_ids = jnp.arange(vocab, dtype=ids.dtype)
  last = jnp.searchsorted(sorted_ids, vocab_ids, side="right") - 1  # [V]
  safe = jnp.maximum(last, 0)
  present = (last >= 0) & (jnp.take(sorted_ids, safe) == vocab_ids)  # [V]
  return jnp.where(present[:, None], jnp.take(sums, safe, axis=0), 0.0)  # [V, D]
