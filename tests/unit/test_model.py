import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_model_config
from transformer_jax.models.common import (TransformerConfig, sinusoidal_positions,
                                           tied_logits)
from transformer_jax.models.transformer import Transformer

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


def _params(cfg, src, tgt):
  # Jitted: op by op, initialising even the tiny model takes 15 s on 2 cores.
  init = jax.jit(Transformer(cfg).init)
  return nn.meta.unbox(init(jax.random.PRNGKey(0), src, tgt)["params"])


def test_base_size_shapes_without_allocating():
  cfg = TransformerConfig(src_vocab_size=37_000, tgt_vocab_size=37_000, share_embeddings=True,
                          tie_output=True)
  src = jax.ShapeDtypeStruct((2, 50), jnp.int32)
  tgt = jax.ShapeDtypeStruct((2, 40), jnp.int32)
  variables = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), src, tgt)
  logits = jax.eval_shape(lambda v, s, t: Transformer(cfg).apply(v, s, t), variables, src, tgt)
  assert logits.shape == (2, 40, 37_000) and logits.dtype == jnp.float32
  params = nn.meta.unbox(variables["params"])
  assert params["encoder_0"]["self_attention"]["query_kernel"].shape == (512, 8, 64)
  assert params["decoder_5"]["ffn"]["wi"]["kernel"].shape == (512, 2048)
  n = sum(np.prod(p.shape) for p in jax.tree.leaves(params))
  # The paper's base model with a shared 37k vocabulary has about 63M parameters.
  assert 60e6 < n < 66e6


def test_every_parameter_has_logical_axis_names():
  cfg = tiny_model_config(pre_ln=True)
  x = jnp.ones((1, 5), jnp.int32)
  boxed = Transformer(cfg).init(jax.random.PRNGKey(0), x, x)["params"]
  leaves = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
  assert leaves and all(isinstance(v, nn.LogicallyPartitioned) for v in leaves)
  assert all(len(v.names) == v.value.ndim for v in leaves)


def test_sinusoidal_positions_match_d2l():
  pe = np.asarray(sinusoidal_positions(jnp.arange(4)[None], 8))[0]
  pos, i = np.arange(4)[:, None], np.arange(0, 8, 2)[None]
  angle = pos / np.power(10000, i / 8)
  np.testing.assert_allclose(pe[:, 0::2], np.sin(angle), atol=1e-6)
  np.testing.assert_allclose(pe[:, 1::2], np.cos(angle), atol=1e-6)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_padded_source_tokens_do_not_reach_outputs(pre_ln):
  cfg = tiny_model_config(pre_ln=pre_ln)
  src = jnp.array([[5, 6, 7, 2, 0, 0], [9, 2, 0, 0, 0, 0]])
  tgt = jnp.array([[1, 8, 9, 0], [1, 4, 0, 0]])
  model = Transformer(cfg)
  params = _params(cfg, src, tgt)
  base = model.apply({"params": params}, src, tgt)
  # Same padding mask (segment ids from the original), other tokens under the padding.
  segments = (src != 0).astype(jnp.int32)
  changed = src.at[:, 4:].set(77)
  out = model.apply({"params": params}, changed, tgt, src_segments=segments)
  real = np.asarray(tgt != 0)  # Padded target rows are never scored.
  np.testing.assert_array_equal(np.asarray(out)[real], np.asarray(base)[real])
  # Control: changing a real token does move the outputs.
  moved = model.apply({"params": params}, src.at[0, 1].set(77), tgt)
  assert not np.allclose(moved[0], base[0])


def test_future_target_tokens_do_not_reach_earlier_positions():
  cfg = tiny_model_config()
  src = jnp.array([[5, 6, 7, 2]])
  tgt = jnp.array([[1, 8, 9, 10, 11]])
  model = Transformer(cfg)
  params = _params(cfg, src, tgt)
  base = model.apply({"params": params}, src, tgt)
  out = model.apply({"params": params}, src, tgt.at[0, 3].set(50))
  np.testing.assert_array_equal(np.asarray(out[0, :3]), np.asarray(base[0, :3]))
  assert not np.allclose(out[0, 3:], base[0, 3:])


def test_attention_weights_path_matches_fused_path_and_is_masked():
  cfg = tiny_model_config()
  src = jnp.array([[5, 6, 7, 2, 0]])
  tgt = jnp.array([[1, 8, 9]])
  params = _params(cfg, src, tgt)
  fused = Transformer(cfg).apply({"params": params}, src, tgt)
  weighted, state = Transformer(dataclasses.replace(cfg, attention_weights=True)).apply(
      {"params": params}, src, tgt, mutable=["intermediates"])
  np.testing.assert_allclose(np.asarray(weighted), np.asarray(fused), atol=1e-5)
  inter = state["intermediates"]
  cross = inter["decoder_0"]["cross_attention"]["attention_weights"][0]  # [B, N, T, S]
  assert cross.shape == (1, 4, 3, 5)
  np.testing.assert_allclose(np.asarray(cross[..., 4]), 0.0, atol=1e-7)  # padding
  dec_self = inter["decoder_1"]["self_attention"]["attention_weights"][0]
  np.testing.assert_allclose(np.asarray(jnp.triu(dec_self[0, 0], 1)), 0.0, atol=1e-7)


def test_bfloat16_compute_keeps_float32_parameters_and_logits():
  cfg = tiny_model_config(dtype="bfloat16")
  x = jnp.array([[5, 6, 2]])
  params = _params(cfg, x, x)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  out = Transformer(cfg).apply({"params": params}, x, x)
  assert out.dtype == jnp.float32
  ref = Transformer(dataclasses.replace(cfg, dtype="float32")).apply({"params": params}, x, x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=0.1)


def test_bad_model_config_names_the_field():
  with pytest.raises(ValueError, match="d_model=30 is not divisible by model.num_heads=4"):
    tiny_model_config(d_model=30)


def _stack_layers(params, num_encoder, num_decoder):
  """Unscanned parameters rearranged as the scanned model holds them."""
  stack = lambda prefix, n: {"layers": {"block": jax.tree.map(
      lambda *xs: jnp.stack(xs), *[params[f"{prefix}_{i}"] for i in range(n)])}}
  out = {k: v for k, v in params.items() if not k.startswith(("encoder_", "decoder_"))}
  out["encoder_stack"] = stack("encoder", num_encoder)
  out["decoder_stack"] = stack("decoder", num_decoder)
  return out


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_give_the_unscanned_outputs(remat):
  from transformer_jax.decoding import generation
  cfg = tiny_model_config(num_encoder_layers=3, num_decoder_layers=2)
  scanned_cfg = dataclasses.replace(cfg, scan_layers=True, remat=remat)
  src = jnp.array([[5, 6, 7, 2, 0], [8, 2, 0, 0, 0]])
  tgt = jnp.array([[1, 9, 10, 11], [1, 12, 0, 0]])
  params = _params(cfg, src, tgt)
  stacked = _stack_layers(params, 3, 2)
  scanned_init = _params(scanned_cfg, src, tgt)
  assert jax.tree.map(jnp.shape, scanned_init) == jax.tree.map(jnp.shape, stacked)
  assert scanned_init["encoder_stack"]["layers"]["block"]["ffn"]["wi"]["kernel"].shape == (
      3, 32, 64)
  # Jitted, as op by op the layers and their gradients are slow.
  full = jax.jit(Transformer(cfg).apply)({"params": params}, src, tgt)
  scanned = jax.jit(Transformer(scanned_cfg).apply)({"params": stacked}, src, tgt)
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(full), atol=1e-5)
  # Gradients agree too (remat changes what is stored, not what is computed).
  loss = lambda model, p: jnp.sum(model.apply({"params": p}, src, tgt) ** 2)
  g_full = jax.jit(jax.grad(lambda p: loss(Transformer(cfg), p)))(params)
  g_scan = jax.jit(jax.grad(lambda p: loss(Transformer(scanned_cfg), p)))(stacked)
  np.testing.assert_allclose(
      np.asarray(g_scan["decoder_stack"]["layers"]["block"]["ffn"]["wo"]["kernel"][1]),
      np.asarray(g_full["decoder_1"]["ffn"]["wo"]["kernel"]), rtol=1e-4, atol=1e-6)
  # Cached decoding of the scanned model matches the teacher-forced pass.
  model = Transformer(scanned_cfg)
  step, cache = generation.decoder(model, stacked, src, 6)
  step = jax.jit(step)
  for t in range(tgt.shape[1]):
    logits, cache = step(tgt[:, t:t + 1], cache)
    real = np.asarray(tgt[:, t] != 0)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(full[:, t])[real], atol=1e-5)


def test_tied_logits_custom_gradient_equals_autodiff():
  rng = np.random.default_rng(0)
  y = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((13, 8)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((2, 3, 13)), jnp.float32)
  ours = lambda y, table: jnp.sum(jnp.tanh(tied_logits(y, table)) * weights)
  plain = lambda y, table: jnp.sum(jnp.tanh(y @ table.T) * weights)
  np.testing.assert_allclose(ours(y, table), plain(y, table), rtol=1e-6)
  for got, want in zip(jax.grad(ours, (0, 1))(y, table), jax.grad(plain, (0, 1))(y, table)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_auto_attention_picks_xla_off_gpu_and_keeps_an_explicit_choice():
  from transformer_jax.models.attention import attention_impl
  expected = "cudnn" if jax.default_backend() == "gpu" else "xla"
  assert attention_impl("auto", "bfloat16", 64) == expected
  assert attention_impl("auto", "float32", 64) == "xla"  # cuDNN's fused kernel: 16-bit only.
  assert attention_impl("auto", "bfloat16", 12) == "xla"  # head dim not a multiple of 8
  assert attention_impl("cudnn", "float32", 64) == "cudnn"
  assert attention_impl("auto", "float32", 64, "tpu") == "splash"


def _packed_rows(length, src_runs, tgt_runs, seed=0):
  """Token, segment and position arrays of packed rows: runs[i] are row i's sentence lengths."""
  def rows(runs):
    seg, pos = np.zeros((len(runs), length), np.int32), np.zeros((len(runs), length), np.int32)
    for r, lengths in enumerate(runs):
      at = 0
      for i, n in enumerate(lengths, 1):
        seg[r, at:at + n], pos[r, at:at + n] = i, np.arange(n)
        at += n
    return seg, pos
  rng = np.random.default_rng(seed)
  (src_seg, src_pos), (tgt_seg, tgt_pos) = rows(src_runs), rows(tgt_runs)
  tokens = lambda seg: jnp.asarray(np.where(seg > 0, rng.integers(4, 128, seg.shape), 0),
                                   jnp.int32)
  return tokens(src_seg), tokens(tgt_seg), src_seg, tgt_seg, src_pos, tgt_pos


def test_splash_attention_on_segment_ids_gives_xla_attentions_numbers():
  """Splash attention (Pallas's interpreter here; TPUs run it natively) reads the mask from the
  packed rows' segment ids: the real positions' logits and every gradient equal those of XLA's
  attention on the dense mask."""
  src, tgt, *rest = _packed_rows(128, [[40, 50, 20], [60, 40]], [[30, 60], [90, 30]])
  tgt_real = rest[1] > 0
  cfg = tiny_model_config()
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), src, tgt)["params"])

  def run(impl):
    model = Transformer(dataclasses.replace(cfg, attention_impl=impl, interpret_kernels=True))
    logits = lambda p: model.apply({"params": p}, src, tgt, *rest)
    loss = lambda p: jnp.sum(jnp.where(tgt_real[..., None], jnp.tanh(logits(p)), 0.0))
    return jax.jit(logits)(params), jax.jit(jax.grad(loss))(params)

  (xla, g_xla), (splash, g_splash) = run("xla"), run("splash")
  np.testing.assert_allclose(np.asarray(splash)[tgt_real], np.asarray(xla)[tgt_real],
                             rtol=1e-5, atol=1e-5)
  for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(g_xla)[0],
                               jax.tree.leaves(g_splash)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


def test_splash_falls_back_to_xla_where_its_blocks_do_not_tile_the_lengths():
  src, tgt, *rest = _packed_rows(24, [[10, 10]], [[12, 8]])
  cfg = tiny_model_config()
  params = Transformer(cfg).init(jax.random.key(0), src, tgt)["params"]
  splash = Transformer(dataclasses.replace(cfg, attention_impl="splash", interpret_kernels=True))
  np.testing.assert_array_equal(np.asarray(splash.apply({"params": params}, src, tgt, *rest)),
                                np.asarray(Transformer(cfg).apply({"params": params}, src, tgt,
                                                                  *rest)))


def _packed_batch():
  """Row 0: two packed sentences and padding; row 1: one sentence and padding."""
  seg = lambda *runs: np.concatenate([np.full(n, s) for s, n in runs]).astype(np.int32)
  pos = lambda s: np.concatenate([np.arange((s == i).sum()) for i in range(1, s.max() + 1)]
                                 + [np.zeros((s == 0).sum())]).astype(np.int32)
  src_seg = np.stack([seg((1, 5), (2, 6), (0, 5)), seg((1, 9), (0, 7))])
  tgt_seg = np.stack([seg((1, 7), (2, 4), (0, 5)), seg((1, 12), (0, 4))])
  rng = np.random.default_rng(3)
  tokens = lambda s: np.where(s > 0, rng.integers(4, 128, s.shape), 0).astype(np.int32)
  return {"inputs": tokens(src_seg), "decoder_inputs": tokens(tgt_seg),
          "targets": tokens(tgt_seg), "inputs_segment_ids": src_seg,
          "targets_segment_ids": tgt_seg, "inputs_positions": np.stack([pos(s) for s in src_seg]),
          "targets_positions": np.stack([pos(s) for s in tgt_seg])}


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="cuDNN fused attention needs an NVIDIA GPU")
def test_cudnn_attention_gives_the_xla_numbers_on_gpu():
  """Logits, loss and gradients on a packed, padded batch in bf16: cuDNN's attention is as close
  to a float32 reference as XLA's bf16 attention is."""
  from transformer_jax.training import steps as step_lib
  cfg = tiny_model_config(dtype="bfloat16", d_model=64, num_heads=4)  # head dim 16
  batch = _packed_batch()
  params = _params(cfg, batch["inputs"], batch["decoder_inputs"])

  def run(**overrides):
    apply = Transformer(dataclasses.replace(cfg, **overrides)).apply

    def loss_fn(p):
      logits = step_lib._apply(apply, p, batch, deterministic=True)
      sums = step_lib.cross_entropy(logits, batch["targets"], batch["targets_segment_ids"] > 0)
      return sums["loss_sum"] / sums["tokens"], logits
    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return loss, logits, np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])

  loss_r, logits_r, grads_r = run(attention_impl="xla", dtype="float32")
  loss_x, logits_x, grads_x = run(attention_impl="xla")
  loss_c, logits_c, grads_c = run(attention_impl="cudnn")
  real = batch["targets_segment_ids"] > 0
  np.testing.assert_allclose(np.asarray(logits_c)[real], np.asarray(logits_x)[real], atol=5e-2)
  np.testing.assert_allclose(float(loss_c), float(loss_x), rtol=1e-2)
  assert np.isfinite(grads_c).all()  # Padding rows (no key to attend to) must not give NaN.
  error = lambda g: np.linalg.norm(g - grads_r) / np.linalg.norm(grads_r)
  print(f"gradient error vs float32: XLA bf16 {error(grads_x):.4f}, cuDNN {error(grads_c):.4f}")
  assert error(grads_c) < max(2 * error(grads_x), 1e-2)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_layer_norm_eps_reaches_every_layer_norm(pre_ln):
  """Each LayerNorm runs with model.layer_norm_eps: every one of the parameter tree's norms is
  called with it, and each call's output is (x - mean) / sqrt(var + eps) * scale + bias with
  that eps, not flax's default."""
  src = jnp.array([[5, 6, 7, 2, 0], [9, 10, 2, 0, 0]], jnp.int32)
  tgt = jnp.array([[1, 11, 12, 2], [1, 13, 2, 0]], jnp.int32)
  logits = {}
  for eps in (1e-6, 1e-5):
    cfg = tiny_model_config(pre_ln=pre_ln, layer_norm_eps=eps)
    params = _params(cfg, src, tgt)
    calls = []

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if isinstance(context.module, nn.LayerNorm) and context.method_name == "__call__":
        calls.append((context.module.epsilon, context.module.scope.path, args[0], out))
      return out

    with nn.intercept_methods(record):
      logits[eps] = Transformer(cfg).apply({"params": params}, src, tgt)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    norms = {tuple(k.key for k in path[:-1]) for path, _ in leaves
             if path[-1].key == "scale" and path[-2].key.endswith("norm")}
    assert {path for _, path, _, _ in calls} == norms  # Every norm of the tree ran.
    assert len(norms) == (2 * 2 + 3 * 2 + 2 * pre_ln)  # 2 encoder blocks, 2 decoder blocks.
    for epsilon, path, x, out in calls:
      assert epsilon == eps
      scale, bias = (params_at(params, path)[k] for k in ("scale", "bias"))
      mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
      expected = (x - mean) / np.sqrt(var + eps) * scale + bias
      np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  # The same weights (same seed) compute another function, if only slightly.
  assert 0 < np.abs(logits[1e-5] - logits[1e-6]).max() < 1e-3


def params_at(params, path):
  for key in path:
    params = params[key]
  return params


@pytest.mark.parametrize("family", ["encoder_decoder", "decoder_only"])
def test_row_lengths_mask_as_the_segment_ids_do(family):
  """model.attention_mask="lengths" (one sequence a row, padding after it: a causal flag and
  each row's length, cuDNN's own mask types) gives the dense segment mask's outputs on every
  real token, exactly (XLA's attention here; cuDNN's on a GPU: test_aot)."""
  from transformer_jax.models.transformer import LanguageModel
  lm = family == "decoder_only"
  cfg = tiny_model_config(family=family, num_encoder_layers=0 if lm else 2,
                          positions="learned" if lm else "sinusoidal", max_len=12)
  lengths = np.array([12, 7, 3, 1])
  segments = (np.arange(12)[None] < lengths[:, None]).astype(np.int32)  # [B, T]
  tokens = np.random.default_rng(0).integers(3, 128, (4, 12)) * segments
  positions = np.broadcast_to(np.arange(12), (4, 12))
  args = (tokens, segments, positions) if lm else (tokens, tokens, segments, segments,
                                                     positions, positions)
  outs, variables = [], None
  for mask in ("segments", "lengths"):  # The same parameters, told of the padding two ways.
    model = (LanguageModel if lm else Transformer)(dataclasses.replace(cfg, attention_mask=mask))
    variables = variables or jax.jit(model.init)(jax.random.PRNGKey(0), *args)
    outs.append(np.asarray(jax.jit(model.apply)(variables, *args)))
  real = segments > 0
  np.testing.assert_array_equal(outs[0][real], outs[1][real])
  # And a later padded token does not move a real one's output.
  moved = tokens.copy()
  moved[1, 9] = 5
  args = (moved,) + args[1:] if lm else (moved, moved) + args[2:]
  again = np.asarray(jax.jit(model.apply)(variables, *args))
  np.testing.assert_array_equal(again[real], outs[1][real])
