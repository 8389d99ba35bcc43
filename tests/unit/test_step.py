"""Gradient accumulation and the chunked (fused) vocabulary projection + loss: the same numbers
as the plain step, with less memory in XLA's ahead-of-time report."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from benchmarks.train_step import synthetic_batch
from tests.conftest import tiny_model_config
from transformer_jax import sharding
from transformer_jax.training import steps as step_lib
from transformer_jax.models.transformer import Transformer


ROWS, LENGTH, VOCAB = 16, 32, 1024


def _batch(rows=ROWS):
  batch = synthetic_batch(rows, LENGTH, VOCAB, seed=1)
  # Ragged rows: the last 3 to 9 target positions are padding.
  for r in range(rows):
    batch["targets_segment_ids"][r, LENGTH - 3 - r % 7:] = 0
  return batch


@functools.lru_cache(maxsize=None)
def _step(step_cfg: step_lib.StepConfig, rows: int = ROWS):
  """(new parameters, metrics, AOT temporaries in bytes) of one compiled train step on _batch:
  the tiny model with a large vocabulary (so that the logits weigh), plain SGD (so that the new
  parameters show the gradients themselves)."""
  mesh = sharding.make_mesh((-1, 1, 1))
  model = Transformer(tiny_model_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
  state, shardings = step_lib.create_train_state(model, optax.sgd(1.0), 0, mesh, LENGTH)
  p_train, _ = step_lib.jit_steps(shardings, mesh, step_cfg)
  with sharding.mesh_context(mesh):
    batch = sharding.global_batch(_batch(rows), mesh)
    compiled = p_train.lower(state, batch).compile()
    old_params = jax.device_get(state.params)
    new_state, metrics = compiled(state, batch)
  assert _max_difference(jax.device_get(new_state.params), old_params) > 1e-3  # It learnt.
  return (jax.device_get(new_state.params), {k: float(v) for k, v in metrics.items()},
          compiled.memory_analysis().temp_size_in_bytes)


def _max_difference(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _assert_params_close(a, b):
  # float32 sums in another order: differences of a few ulps of the largest gradient.
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_accumulated_microbatches_give_the_update_of_the_whole_batch():
  whole_params, whole, _ = _step(step_lib.StepConfig(label_smoothing=0.1))
  accum_params, accum, _ = _step(step_lib.StepConfig(label_smoothing=0.1, grad_accum_steps=4))
  _assert_params_close(accum_params, whole_params)
  assert accum["tokens"] == whole["tokens"] == float((_batch()["targets_segment_ids"] > 0).sum())
  for key in ("loss", "nll", "grad_norm"):
    np.testing.assert_allclose(accum[key], whole[key], rtol=1e-6)


def test_accumulated_step_needs_about_the_memory_of_one_microbatch():
  micro = _step(step_lib.StepConfig(label_smoothing=0.1), ROWS // 4)[2]
  accumulated = _step(step_lib.StepConfig(label_smoothing=0.1, grad_accum_steps=4))[2]
  whole = _step(step_lib.StepConfig(label_smoothing=0.1))[2]
  assert accumulated <= 1.2 * micro
  assert whole > 2 * micro  # The batch's activations would be 4x those of a microbatch.


def test_chunked_loss_equals_the_full_loss_through_the_tied_embedding():
  # The untied output projection is compared in the train-step tests below.
  model = Transformer(tiny_model_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                                        tie_output=True, share_embeddings=True))
  batch = _batch()
  params = nn.meta.unbox(model.init(jax.random.key(0), batch["inputs"][:1],
                                    batch["decoder_inputs"][:1])["params"])

  def sums(params, chunks):
    return step_lib.loss_sums(model.apply, params, batch, 0.1, chunks)

  grad = lambda chunks: jax.jit(jax.grad(lambda p: sums(p, chunks)["loss_sum"]))(params)
  full, chunked = jax.jit(sums, static_argnums=1)(params, 1), jax.jit(
      sums, static_argnums=1)(params, 4)
  assert chunked["tokens"] == full["tokens"] and chunked["correct"] == full["correct"]
  for key in ("loss_sum", "nll_sum"):
    np.testing.assert_allclose(chunked[key], full[key], rtol=1e-6)
  full_grad, chunked_grad = grad(1), grad(4)
  assert full_grad.keys() == chunked_grad.keys()
  for x, y in zip(jax.tree.leaves(chunked_grad), jax.tree.leaves(full_grad)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  # The output layer's gradient is really there (and really compared).
  assert float(np.abs(full_grad["src_embed"]["embedding"]).max()) > 1e-2


def test_chunked_loss_step_equals_the_plain_step_with_less_memory():
  plain_params, plain, plain_temporaries = _step(step_lib.StepConfig(label_smoothing=0.1))
  chunked_params, chunked, chunked_temporaries = _step(
      step_lib.StepConfig(label_smoothing=0.1, loss_chunks=4))
  _assert_params_close(chunked_params, plain_params)
  np.testing.assert_allclose(chunked["loss"], plain["loss"], rtol=1e-6)
  assert chunked_temporaries <= 0.8 * plain_temporaries


def test_loss_chunks_must_divide_the_length():
  model = Transformer(tiny_model_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
  batch = _batch()
  params = nn.meta.unbox(model.init(jax.random.key(0), batch["inputs"][:1],
                                    batch["decoder_inputs"][:1])["params"])
  with pytest.raises(ValueError, match="loss_chunks=5 does not divide the target length 32"):
    step_lib.loss_sums(model.apply, params, batch, 0.1, 5)


def test_moving_average_follows_the_parameters_and_skips_non_finite_steps():
  mesh = sharding.make_mesh((-1, 1, 1))
  model = Transformer(tiny_model_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
  state, shardings = step_lib.create_train_state(model, optax.sgd(1.0), 0, mesh, LENGTH,
                                                  ema=True)
  cfg = step_lib.StepConfig(label_smoothing=0.1, ema_decay=0.5, nan_at_step=3)
  p_train, p_eval = step_lib.jit_steps(shardings, mesh, cfg)
  expected = jax.device_get(state.params)  # The average starts at the initial parameters.
  with sharding.mesh_context(mesh):
    batch = sharding.global_batch(_batch(), mesh)
    for step in range(4):
      state, metrics = p_train(state, batch)
      params = jax.device_get(state.params)
      if step == 2:  # Step 3's loss is NaN: nothing changes, the average included.
        assert float(metrics["nonfinite"]) == 1
      else:
        d = min(0.5, (1 + step) / (10 + step))  # 0.1, 0.18, -, 0.3
        expected = jax.tree.map(lambda e, p: d * e + (1 - d) * p, expected, params)
      ema = jax.device_get(state.ema_params)
      for x, y in zip(jax.tree.leaves(ema), jax.tree.leaves(expected)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert _max_difference(ema, params) > 1e-3  # The average really lags the parameters.
    # Evaluation uses the average.
    got = p_eval(state, batch)
    want = step_lib.loss_sums(model.apply, state.ema_params, batch)
    np.testing.assert_allclose(float(got["nll_sum"]), float(want["nll_sum"]), rtol=1e-6)


def test_a_scanned_bfloat16_model_initializes_and_trains_a_step():
  """The scanned stack's carry keeps the compute dtype (a NumPy scale once made it float32)."""
  mesh = sharding.make_mesh((-1, 1, 1))
  model = Transformer(tiny_model_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                                        dtype="bfloat16", scan_layers=True))
  state, shardings = step_lib.create_train_state(model, optax.adam(1e-3), 0, mesh, LENGTH)
  before = jax.tree.map(np.asarray, state.params)
  p_train, _ = step_lib.jit_steps(shardings, mesh, step_lib.StepConfig())
  with sharding.mesh_context(mesh):
    state, metrics = p_train(state, sharding.global_batch(_batch(), mesh))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) > 0
  assert jax.tree.leaves(state.params)[0].dtype == np.float32  # Parameters stay float32.
  changed = [not np.array_equal(a, np.asarray(b))
             for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert all(changed)


def test_the_abstract_state_is_the_created_state_without_values():
  mesh = sharding.make_mesh((-1, 1, 1))
  model = Transformer(tiny_model_config())
  tx = optax.adam(1e-3)
  abstract, shardings = step_lib.abstract_train_state(model, tx, mesh, LENGTH, ema=True)
  state, created_shardings = step_lib.create_train_state(model, tx, 0, mesh, LENGTH, ema=True)
  assert shardings == created_shardings
  pairs = list(zip(jax.tree.leaves(abstract), jax.tree.leaves(state)))
  assert len(pairs) == len(jax.tree.leaves(state)) > 0
  for a, x in pairs:
    assert isinstance(a, jax.ShapeDtypeStruct)
    assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)


@pytest.mark.quick
def test_the_time_left_counts_the_evaluations_to_come(monkeypatch):
  """The training line's time left: the steps left at the measured rate (evaluations
  excluded) and the evaluations left at the mean time of those done."""
  from transformer_jax.training import writers
  clock = [0.0]
  monkeypatch.setattr(writers.time, "perf_counter", lambda: clock[0])
  progress = writers.Progress(num_steps=100, start_step=0, eval_every=25)
  assert progress.seconds_left(0, 1.0) == 100  # No evaluation measured yet.
  clock[0] = 25.0
  progress.report(25)
  clock[0] = 85.0
  progress.exclude(60.0)  # The evaluation at step 25 took a minute.
  clock[0] = 110.0
  rate = progress.report(50)["steps_per_sec"]
  assert rate == 1.0 and progress.evals_left(50) == 2  # At steps 75 and 100.
  assert progress.seconds_left(50, rate) == 50 + 2 * 60
  last = writers.Progress(num_steps=90, start_step=0, eval_every=25)
  assert [last.evals_left(s) for s in (10, 74, 75, 80, 90)] == [4, 2, 1, 1, 0]


def test_the_masked_positions_logits_alone_give_the_whole_batchs_sums_and_gradients():
  """at_masked: a masked language model's sums and gradients from the masked positions'
  logits only, equal (to float32's order of summation) to every position's; with more masked
  positions than its budget, every position's logits, exactly as without it."""
  rng = np.random.default_rng(0)
  features = rng.normal(size=(4, 16, 8)).astype(np.float32)
  kernel = rng.normal(size=(8, 24)).astype(np.float32)
  targets = rng.integers(0, 24, (4, 16))
  masked = rng.random((4, 16)) < 0.2
  masking = step_lib.Masking(mask_id=24, vocab_size=24, rate=0.2)
  budget = step_lib.prediction_budget((4, 16), masking)
  assert budget == 64 and masked.sum() < budget  # 2 x 20% of 64 tokens, rounded up to 128: all.
  assert step_lib.prediction_budget((32, 128), masking) == 1664  # 2 x 819.2, rounded up.

  def sums(features, kernel, budget):
    logits_of = lambda f: f @ kernel
    if budget:
      return step_lib.at_masked(logits_of, features, targets, masked, 0.1, budget)
    return step_lib.cross_entropy(logits_of(features), targets, masked, 0.1)

  loss = lambda budget: jax.jit(jax.value_and_grad(
      lambda f, k: sums(f, k, budget)["loss_sum"], argnums=(0, 1)))(features, kernel)
  (whole, whole_grads), (gathered, gathered_grads) = loss(0), loss(16)
  assert masked.sum() <= 16
  np.testing.assert_allclose(gathered, whole, rtol=1e-6)
  for x, y in zip(gathered_grads, whole_grads):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  assert float(np.abs(gathered_grads[0][~masked]).max()) == 0.0  # Unmasked rows: no gradient.
  got = jax.jit(sums, static_argnums=2)(features, kernel, 16)
  want = jax.jit(sums, static_argnums=2)(features, kernel, 0)
  assert got["tokens"] == want["tokens"] == masked.sum() and got["correct"] == want["correct"]
  over = jax.jit(sums, static_argnums=2)(features, kernel, 4)  # 4 < the masked count.
  assert {k: float(v) for k, v in over.items()} == {k: float(v) for k, v in want.items()}


def test_gelu_is_the_erf_form_within_float32_noise_of_jaxs():
  from transformer_jax.models.blocks import gelu_erf
  x = np.linspace(-12, 12, 10001, dtype=np.float32)
  np.testing.assert_allclose(gelu_erf(x), jax.nn.gelu(x, approximate=False), atol=2e-6)
  grad = jax.vmap(jax.grad(gelu_erf))(x)
  want = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=False)))(x)
  np.testing.assert_allclose(grad, want, atol=2e-6)


def test_muon_orthogonalizes_the_block_matrices_and_leaves_the_rest_to_adam():
  """Muon's matrices are read from the logical axis names: each attention kernel as the
  product it computes ([D, N*H] or [N*H, D]), the FFN's, a scanned stack's per layer; the
  embedding (tied to the output), norms and biases go through Adam."""
  from transformer_jax.models import build
  for scan in (False, True):
    model = Transformer(tiny_model_config(scan_layers=scan))
    dims = step_lib.muon_dimensions(build.abstract_params(model))
    flat = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(
        dims, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))[0]}
    lead = 1 if scan else 0  # The stack's "layers" axis leads: a batch axis.
    block = "['encoder_stack']['layers']['block']" if scan else "['encoder_0']"
    got = {name.removeprefix(block): (d and (d.reduction_axis, d.output_axis))
           for name, d in flat.items() if name.startswith(block)}
    shift = lambda *axes: tuple(lead + a for a in axes)
    assert got["['self_attention']['query_kernel']"] == (shift(0), shift(1, 2))
    assert got["['self_attention']['out_kernel']"] == (shift(0, 1), shift(2))
    assert got["['ffn']['wi']['kernel']"] == (shift(0), shift(1))
    assert got["['ffn']['wo']['kernel']"] == (shift(0), shift(1))
    for adam in ("['self_attention']['query_bias']", "['self_attention']['out_bias']",
                 "['ffn']['wi']['bias']", "['attention_sublayer']['norm']['scale']"):
      assert got[adam] is None, adam
    assert flat["['src_embed']['embedding']"] is None


def test_schedule_free_state_evaluates_at_its_averaged_point():
  """The train state's ema_params under schedule-free AdamW are optax's evaluation
  parameters of the step's state, not the point its gradients were taken at."""
  cfg = step_lib.OptimizerConfig(name="schedule_free_adamw", schedule="constant",
                                  warmup_steps=2, learning_rate=1e-2)
  model = Transformer(tiny_model_config(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB))
  mesh = sharding.make_mesh((-1, 1, 1))
  state, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(cfg, 10), 0, mesh, LENGTH, ema=True)
  p_train, _ = step_lib.jit_steps(shardings, mesh, step_lib.StepConfig())
  with sharding.mesh_context(mesh):
    for _ in range(3):
      state, _ = p_train(state, sharding.global_batch(_batch(), mesh))
  expected = optax.contrib.schedule_free_eval_params(
      step_lib.schedule_free_state(state.opt_state), state.params)
  for got, want, y in zip(jax.tree.leaves(state.ema_params), jax.tree.leaves(expected),
                          jax.tree.leaves(state.params)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(state.ema_params),
                                                   jax.tree.leaves(state.params)))
