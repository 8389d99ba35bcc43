"""The embedding tables' gradients without a scatter-add: equal to autodiff's, in every model
table (source, target, tied), on one device and split over data shards."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_model_config
from transformer_jax.models import embedding
from transformer_jax.models.transformer import Transformer

pytestmark = pytest.mark.quick

VOCAB, D = 256, 16


def _text_like(rows=8, length=24, seed=0):
  """Zipf-distributed ids (a few of them very common) with padding (id 0) at each row's end:
  the collisions that make a GPU's scatter-add slow."""
  rng = np.random.default_rng(seed)
  ids = np.minimum(rng.zipf(1.3, (rows, length)), VOCAB - 1).astype(np.int32)
  ids[np.arange(length)[None] >= rng.integers(4, length, (rows, 1))] = 0
  g = rng.standard_normal((rows, length, D)).astype(np.float32)
  table = rng.standard_normal((VOCAB, D)).astype(np.float32)
  return jnp.asarray(table), jnp.asarray(ids), jnp.asarray(g)


def _table_grad(impl, table, ids, g, dtype=jnp.float32, shards=1):
  loss = lambda t: jnp.sum(embedding.lookup(t, ids, dtype, impl, shards).astype(jnp.float32) * g)
  return np.asarray(jax.jit(jax.grad(loss))(table), np.float64)


def _relative_error(got, want):
  return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("impl,shards", [("onehot", 1), ("sorted", 1), ("sorted", 4)])
def test_float32_gradient_equals_autodiffs(impl, shards):
  table, ids, g = _text_like()
  want = _table_grad("scatter", table, ids, g)
  got = _table_grad(impl, table, ids, g, shards=shards)
  assert _relative_error(got, want) < 1e-6
  # Rows of ids that never occur get exactly zero, and the padding row its many rows' sum.
  absent = np.setdiff1d(np.arange(VOCAB), np.asarray(ids))
  assert absent.size and not got[absent].any()
  assert np.count_nonzero(np.asarray(ids) == 0) > 20 and got[0].any()


@pytest.mark.parametrize("impl", ["onehot", "sorted"])
def test_bfloat16_gradient_is_the_exact_sum_of_the_rounded_rows(impl):
  """In bfloat16 the only error is the rounding of each output-gradient row to bfloat16: the
  rows are then summed in float32 (autodiff's scatter-add sums in bfloat16, and is further
  off)."""
  table, ids, g = _text_like()
  rounded = np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32), np.float64).reshape(-1, D)
  exact = np.zeros((VOCAB, D))
  np.add.at(exact, np.asarray(ids).reshape(-1), rounded)
  got = _table_grad(impl, table, ids, g, dtype=jnp.bfloat16)
  assert _relative_error(got, exact) < 1e-6
  autodiff = _table_grad("scatter", table, ids, g, dtype=jnp.bfloat16)
  assert _relative_error(autodiff, exact) > 1e-3
  # The lookup itself is autodiff's: the table's rows in bfloat16.
  np.testing.assert_array_equal(
      np.asarray(embedding.lookup(table, ids, jnp.bfloat16, impl), np.float32),
      np.asarray(embedding.lookup(table, ids, jnp.bfloat16, "scatter"), np.float32))


@pytest.mark.parametrize("shared,tied", [(False, False), (True, True)])
@pytest.mark.parametrize("impl", ["onehot", "sorted"])
def test_every_model_table_gets_autodiffs_gradient(impl, shared, tied):
  """Source and target tables, or one table shared by both sides and the tied output."""
  rng = np.random.default_rng(1)
  src = jnp.asarray(np.where(np.arange(10) < rng.integers(3, 10, (4, 1)),
                             rng.integers(4, 128, (4, 10)), 0), jnp.int32)
  tgt = jnp.asarray(np.where(np.arange(8) < rng.integers(3, 8, (4, 1)),
                             rng.integers(4, 128, (4, 8)), 0), jnp.int32)
  cfg = tiny_model_config(share_embeddings=shared, tie_output=tied, embed_grad="scatter")
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), src, tgt)["params"])

  def grads(embed_grad):
    model = Transformer(dataclasses.replace(cfg, embed_grad=embed_grad))
    loss = lambda p: jnp.sum(jnp.tanh(model.apply({"params": p}, src, tgt)))
    return jax.jit(jax.grad(loss))(params)

  want, got = grads("scatter"), grads(impl)
  tables = ["src_embed"] + ([] if shared else ["tgt_embed"])
  for name in tables:
    w, o = (np.asarray(x[name]["embedding"], np.float64) for x in (want, got))
    assert _relative_error(o, w) < 1e-6, name
  # Everything else is untouched by the choice.
  for (path, w), o in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(o), np.asarray(w), rtol=1e-5, atol=1e-7,
                               err_msg=jax.tree_util.keystr(path))


def test_auto_picks_per_platform():
  assert embedding.grad_impl("auto", "gpu") == "sorted"
  assert embedding.grad_impl("auto", "cuda") == "sorted"
  assert embedding.grad_impl("auto", "tpu") == "onehot"
  assert embedding.grad_impl("auto", "cpu") == "scatter"
  assert embedding.grad_impl("onehot", "gpu") == "onehot"  # An explicit choice is kept.
