"""Ahead-of-time compilation for TPU topologies and GPU targets on this CPU host, with the real
compiler plugins (libtpu, jax's CUDA plugin), installed once into their own directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import DATA, ROOT
from transformer_jax.training import hlo as hlo_lib, targets

# The smoke config at d_model 128 without dropout: at d_model 32 elementwise work and dropout's
# random bits (which XLA counts as FLOPs) are a large share of the step, and the comparison
# with the analytic count (matrix products and attention only) would measure them instead.
# The embedding gradient by scatter-add: TPUs' one-hot product (embed_grad auto) is work the
# analytic count leaves out.
FLOP_CHECK = ["--config.model.d_model=128", "--config.model.ffn_dim=512",
              "--config.model.dropout_rate=0.0", "--config.model.embed_grad=scatter"]


@pytest.fixture(scope="module")
def plugins():
  """The pinned compiler plugins, installed once by the command's own --install_plugins into
  the user's cache (targets.DEFAULT_PLUGINS), where every later run finds them. Where they
  cannot be installed (no package index), the tests that need them are skipped with pip's
  reason, which the summary prints in one line (pytest's -rs)."""
  directory = targets.plugins_dir()
  if not (directory / "libtpu").is_dir() or not (directory / "jax_plugins").is_dir():
    result = subprocess.run([sys.executable, "-m", "transformer_jax", "aot", "--install_plugins"],
                            cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
      why = (result.stderr.strip().splitlines() or ["no output"])[-1]
      pytest.skip(f"aot's compiler plugins are not in {directory} and could not be installed "
                  f"(`python -m transformer_jax aot --install_plugins`: {why})")
  return directory


def _aot(plugins, *args, json_path=None, config="configs/fra_eng.py:smoke"):
  env = dict(os.environ, **{targets.PLUGINS_ENV: str(plugins)})
  env.pop("JAX_PLATFORMS", None)  # The command sets its own.
  extra = ["--json", str(json_path)] if json_path else []
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "aot",
                           "--config", config, *args, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  report = json.loads(json_path.read_text()) if json_path and json_path.exists() else None
  return result, report


def _error_line(result):
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(lines) == 1 and result.stderr.strip().splitlines()[-1] == lines[0], result.stderr
  return lines[0]


def test_the_smoke_config_compiles_for_a_tpu_topology(plugins, tmp_path):
  result, report = _aot(plugins, "--topology", "v5e:2x2", *FLOP_CHECK,
                        json_path=tmp_path / "v5e.json")
  assert result.returncode == 0, result.stderr[-3000:]
  assert report["platform"] == "tpu" and report["num_devices"] == 4 and report["fits"]
  assert report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  assert set(report["programs"]) == {"train", "eval", "decode"}
  train, evaluate = report["programs"]["train"], report["programs"]["eval"]
  for program in (train, evaluate):
    assert 0.9 <= program["xla_over_analytic"] <= 1.1, program
    assert 0 < program["total_bytes"] <= report["hbm_bytes_per_device"]
  # Data parallelism: the gradients are summed over the 4 devices.
  assert train["collectives"]["all-reduce"]["count"] >= 1
  assert train["collectives"]["all-reduce"]["bytes"] >= report["params_bytes_per_device"]
  # The state is donated: its buffers are the outputs' too.
  assert train["alias_size_in_bytes"] >= (report["params_bytes_per_device"]
                                          + report["opt_state_bytes_per_device"])
  assert "train: args" in result.stdout and "fits" in result.stdout


def test_the_smoke_config_compiles_for_h100(plugins, tmp_path):
  result, report = _aot(plugins, "--topology", "h100:2", "--programs", "train,decode",
                        json_path=tmp_path / "h100.json")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "cudart_stub" not in result.stderr, result.stderr[:2000]
  assert report["platform"] == "gpu" and report["num_devices"] == 2 and report["fits"]
  assert report["hbm_bytes_per_device"] == 84942979072  # From the H100 target spec.
  assert report["programs"]["train"]["temp_size_in_bytes"] > 0
  assert report["programs"]["train"]["collectives"]["all-reduce"]["count"] >= 1
  # The beam search is the decoder's one loop: moved beams' cache rows are gathered, not
  # copied in a loop of their own inside each step (a CPU's way, decoding/platforms.py).
  assert report["programs"]["decode"]["while_loops"] == 1


@pytest.mark.parametrize("topology,embed_grad,attention,kernels", [
    ("h100:1", "sorted", "xla", 0), ("v5e:2x2", "onehot", "splash", 18)])
def test_the_train_step_has_no_scatter_into_an_embedding_table(plugins, tmp_path, topology,
                                                                embed_grad, attention, kernels):
  """Read from the optimized HLO the target compiler produced, with the config's default
  fields (rows of 128 tokens, which splash attention's blocks tile): the table's gradient is
  not a scatter-add (slow under colliding ids on GPUs), and on the TPU the attention is splash's
  kernel on segment ids (6 attentions, each a forward and two backward kernels)."""
  rows = "--config.data.max_len=128"
  result, report = _aot(plugins, "--topology", topology, "--programs", "train", rows, "--hlo",
                        str(tmp_path / "hlo"), json_path=tmp_path / "r.json")
  assert result.returncode == 0, result.stderr[-3000:]
  assert (report["embed_grad"], report["attention_impl"]) == (embed_grad, attention)
  train = report["programs"]["train"]
  assert train["embedding_scatters"] == 0 and train["scatters"] == {}
  assert train["custom_calls"].get("tpu_custom_call", 0) == kernels
  assert " scatter(" not in (tmp_path / "hlo" / "train.hlo.txt").read_text()


def test_the_scatter_count_sees_autodiffs_embedding_gradient(plugins, tmp_path):
  """One scatter-add into the shared [512, 32] table per lookup (source and target); and XLA's
  attention, no kernel."""
  rows = "--config.data.max_len=128"
  result, report = _aot(plugins, "--topology", "h100:1", "--programs", "train", rows,
                        "--config.model.embed_grad=scatter", "--config.model.attention_impl=xla",
                        json_path=tmp_path / "r.json")
  assert result.returncode == 0, result.stderr[-3000:]
  assert report["programs"]["train"]["scatters"] == {"f32[512,32]": 2}
  assert report["programs"]["train"]["embedding_scatters"] == 2
  assert "tpu_custom_call" not in report["programs"]["train"]["custom_calls"]


def test_fsdp_splits_parameters_and_optimizer_state(plugins, tmp_path):
  reports = {}
  for mesh in ("(4,1,1)", "(1,4,1)"):
    result, reports[mesh] = _aot(plugins, "--topology", "v5e:2x2", "--programs", "train",
                                 f"--config.run.mesh_shape={mesh}", json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.stderr[-3000:]
  data, fsdp = reports["(4,1,1)"], reports["(1,4,1)"]
  for key in ("params_bytes_per_device", "opt_state_bytes_per_device"):
    assert fsdp[key] == pytest.approx(data[key] / 4, rel=0.05), key
  # The compiled program's arguments shrink with them (by less than 3/4 of the state: the TPU
  # pads each array to whole tiles, and the smoke model's arrays are small).
  state = data["params_bytes_per_device"] + data["opt_state_bytes_per_device"]
  saved = (data["programs"]["train"]["argument_size_in_bytes"]
           - fsdp["programs"]["train"]["argument_size_in_bytes"])
  assert state / 2 < saved < state
  # FSDP gathers the split parameters before using them; pure data parallelism never does.
  assert fsdp["programs"]["train"]["collectives"]["all-gather"]["count"] >= 1
  assert "all-gather" not in data["programs"]["train"]["collectives"]


def test_a_batch_that_does_not_fit_is_a_verdict_and_a_nonzero_exit(plugins, tmp_path):
  # 262,144 rows x 32 positions x 512 logits in float32 alone are 16 GiB a v5e chip lacks.
  result, report = _aot(plugins, "--topology", "v5e:2x2", "--programs", "train",
                        "--config.data.batch_size=262144", json_path=tmp_path / "big.json")
  assert result.returncode == 3
  assert _error_line(result) == "error: train does not fit in v5e's 16.00 GiB per device"
  assert report["fits"] is False and report["programs"]["train"]["fits"] is False
  assert "DOES NOT FIT" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--topology", "v9:2x2"], "error: --topology 'v9:2x2' is not a known target"),
    (["--topology", "v5e:2x2", "--config.run.mesh_shape=(8,1,1)"],
     "error: v5e:2x2 (4 devices): run.mesh_shape (8, 1, 1) needs 8 devices, found 4 (tpu)"),
    (["--topology", "v5e:2x2", "--config.data.batch_size=6"],
     "error: v5e:2x2 (4 devices): data.batch_size=6 does not split over the mesh's 4 data-parallel "
     "devices"),
])
def test_bad_targets_are_one_line(plugins, args, message):
  result, _ = _aot(plugins, *args)
  assert result.returncode == 1
  assert _error_line(result).startswith(message)


def test_cudnn_attention_without_cudnn_names_its_install_command(plugins, tmp_path):
  """The CUDA plugin without cuDNN's library: hard links to its files in a directory of their
  own (the plugin looks for libraries beside its real path, so a symbolic link would not do)."""
  bare = tmp_path / "plugins"
  for entry in plugins.iterdir():
    if entry.name.startswith(("jax_plugins", "jax_cuda12")):
      shutil.copytree(entry, bare / entry.name, copy_function=os.link)
  result, _ = _aot(bare, "--topology", "h100:1", "--config.model.dtype=bfloat16")
  assert result.returncode == 1
  line = _error_line(result)
  assert line.startswith("error: cuDNN's fused attention (model.attention_impl='auto': bfloat16 "
                         "on a GPU) needs cuDNN's library to compile; install it with: "), line
  assert f"--target {bare} nvidia-cudnn-cu12==" in line


@pytest.fixture(scope="module")
def cudnn(plugins):
  """cuDNN's library beside the plugins, installed by the command's own --install_cudnn."""
  if not (plugins / "nvidia" / "cudnn").is_dir():
    subprocess.run([sys.executable, "-m", "transformer_jax", "aot", "--install_cudnn"],
                   cwd=ROOT, check=True, timeout=1800)
  return plugins


def test_causal_attention_reaches_cudnn_as_its_mask_type_not_a_dense_bias(cudnn, tmp_path):
  """The language model's smoke step compiled for an H100 with cuDNN's attention, read from
  its optimized HLO (the step's shape pinned: a change that adds a kernel to a layer, a
  [tokens, vocab] array or a dense mask shows here). Segment ids (packed rows) reach cuDNN as a
  [rows, 1, T, T] bias; row lengths (model.attention_mask=lengths) as its padding-causal mask
  type, with no bias."""
  shapes = {}
  for mask in ("segments", "lengths"):
    result, report = _aot(cudnn, "--topology", "h100:1", "--programs", "train",
                          f"--config.model.attention_mask={mask}",
                          f"--config.data.packing={mask == 'segments'}",
                          config="configs/lm_gpt2_small.py:smoke", json_path=tmp_path / "r.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["attention_impl"] == "cudnn"
    shapes[mask] = report["programs"]["train"]["step_shape"]
    assert "cuDNN attention: " in result.stdout and "layer loop 2 (x2)" in result.stdout
  dense, lengths = shapes["segments"], shapes["lengths"]
  assert dense["attention"] == {
      "calls": {"__cudnn$fmhaScaleBiasSoftmax": 2, "__cudnn$fmhaScaleBiasSoftmaxBackward": 1},
      "with_bias": 3, "mask_types": {"NO_MASK": 3}}
  assert dense["mask_arrays"] == {"bf16[16,1,32,32]": {"count": 2, "bytes": 2 * 16 * 32 * 32 * 2}}
  assert lengths["attention"] == {
      "calls": {"__cudnn$fmhaSoftmax": 2, "__cudnn$fmhaSoftmaxBackward": 1},
      "with_bias": 0, "mask_types": {"PADDING_CAUSAL": 3}}
  assert lengths["mask_arrays"] == {}
  # The scanned stack: a forward loop (under remat "dots", the backward pass's recomputation
  # too) and a backward loop of 2 layers; a layer's kernels in each.
  assert [(loop["trip_count"], loop["fusions"]) for loop in dense["layer_loops"]] == [
      (2, 24), (2, 51)]
  assert [(loop["trip_count"], loop["fusions"]) for loop in lengths["layer_loops"]] == [
      (2, 24), (2, 51)]
  # The logits and their gradient, in bfloat16; no float32 copy of either.
  for shape in (dense, lengths):
    assert sorted(shape["vocab_arrays"]) == ["bf16[16,32,512]", "bf16[512,512]"]


def test_help_names_every_kind_of_target_without_the_plugins_load_noise(plugins):
  result, _ = _aot(plugins, "--help")
  assert result.returncode == 0, result.stderr[-3000:]
  for target in ("v5e:2x4", "v6e:2x2", "v4:2x2x2", "v5p:2x2x2", "h100:1", "h100:8", "a100:8",
                 "h100:2x8", "cpu:8"):
    assert target in result.stdout, target
  # The CUDA plugin's libraries print these from C++ as they load on a host without CUDA.
  assert "cudart_stub" not in result.stderr and "absl::InitializeLog" not in result.stderr


def test_missing_plugins_name_the_install_command(tmp_path):
  result, _ = _aot(tmp_path / "no-plugins", "--topology", "v5e:2x2")
  assert result.returncode == 1
  line = _error_line(result)
  assert line.startswith("error: compiling for v5e:2x2 needs the TPU compiler plugin")
  assert f"--target {tmp_path / 'no-plugins'} libtpu==" in line


def test_scatters_are_counted_from_hlo_text():
  hlo = "\n".join([
      "  %scatter.3 = f32[512,32]{1,0} scatter(f32[512,32]{1,0} %z, s32[64,1]{1,0} %i, "
      "f32[64,32]{1,0} %u), update_window_dims={1}, to_apply=%add",
      "  %s2 = (f32[512,16]{1,0}, s32[7]{0}) scatter(f32[512,16]{1,0} %a, s32[7]{0} %b)",
      "  %g = f32[64,32]{1,0} gather(f32[512,32]{1,0} %t, s32[64,1]{1,0} %i)",
  ])
  counts = hlo_lib.scatters(hlo)
  assert counts == {"f32[512,32]": 1, "f32[512,16], s32[7]": 1}
  assert hlo_lib.embedding_scatters(counts, [(512, 32)]) == 1
  assert hlo_lib.embedding_scatters(counts, [(512, 16), (512, 32)]) == 2
  assert hlo_lib.embedding_scatters(counts, [(256, 32)]) == 0


def test_custom_calls_are_counted_from_hlo_text():
  hlo = "\n".join([
      '  %c = bf16[8,128]{1,0} custom-call(bf16[8,128]{1,0} %q), custom_call_target="tpu_custom_call"',
      '  %d = bf16[8,128]{1,0} custom-call(bf16[8,128]{1,0} %k), custom_call_target="tpu_custom_call"',
      '  %e = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="Sharding"',
  ])
  assert hlo_lib.custom_calls(hlo) == {"tpu_custom_call": 2, "Sharding": 1}


def test_collectives_are_counted_from_hlo_text():
  hlo = "\n".join([
      "  %all-reduce.1 = f32[128,64]{1,0} all-reduce(f32[128,64]{1,0} %p), replica_groups={}",
      "  %ag = (bf16[8,16]{1,0}, bf16[32,16]{1,0}) all-gather-start(bf16[8,16]{1,0} %x)",
      "  %agd = bf16[32,16]{1,0} all-gather-done((bf16[8,16]{1,0}, bf16[32,16]{1,0}) %ag)",
      "  %ars = (f32[10]{0}, s32[3]{0}) all-reduce-start(f32[10]{0} %a, s32[3]{0} %b)",
      "  %add = f32[128,64]{1,0} add(f32[128,64]{1,0} %x, f32[128,64]{1,0} %y)",
  ])
  assert hlo_lib.collectives(hlo) == {
      "all-reduce": {"count": 2, "bytes": 128 * 64 * 4 + 10 * 4 + 3 * 4},
      "all-gather": {"count": 1, "bytes": 32 * 16 * 2}}


def test_a_saved_train_step_is_what_train_py_runs(tmp_path, cache_dir, fra_eng_builder,
                                                   tfds_dir):
  """Compiled ahead of time for this host's CPU, saved, loaded by train.py in place of its own
  compile: the same losses as a run that compiles; another program is refused."""
  saved = tmp_path / "train_step.bin"
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "aot", "--config",
                           "configs/fra_eng.py:smoke", "--topology", "cpu:1", "--programs",
                           "train", "--save_train_step", str(saved)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]

  def train(workdir, *extra):
    return subprocess.run(
        [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke", "--workdir",
         str(workdir), f"--config.data.data_dir={DATA / 'fra-eng'}",
         f"--config.data.tfds_dir={tfds_dir}",
         f"--config.run.compilation_cache_dir={cache_dir}", "--config.data.num_workers=0",
         "--config.eval.bleu_sentences=0", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600)

  loaded = train(tmp_path / "loaded", f"--config.run.compiled_train_step={saved}")
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  assert f"Running the train step compiled ahead of time in {saved}" in loaded.stderr
  compiled = train(tmp_path / "compiled")
  assert compiled.returncode == 0, compiled.stderr[-3000:]
  losses = lambda w: [(r["step"], r["train/loss"], r["train/grad_norm"])
                      for r in map(json.loads, (w / "metrics.jsonl").read_text().splitlines())
                      if "train/loss" in r]
  assert losses(tmp_path / "loaded") == losses(tmp_path / "compiled") != []

  other = train(tmp_path / "other", f"--config.run.compiled_train_step={saved}",
                "--config.data.batch_size=32")
  assert other.returncode == 1
  assert _error_line(other) == (
      f"error: compiled_train_step {saved} holds another program than this run's train step "
      "(the config, mesh or code differ): compile it again for this config")
  assert not (tmp_path / "other" / "checkpoints").exists()


# XLA's count of the TPU program: layers unrolled (a scanned stack's loop body is counted once),
# XLA's attention (splash's kernels are not counted) and the scatter-add gradient (the one-hot
# product's FLOPs are not in the formula).
LM_FLOP_CHECK = ["--config.model.embed_grad=scatter", "--config.model.scan_layers=False",
                 "--config.model.attention_impl=xla"]


@pytest.mark.parametrize("topology, extra", [
    ("v5e:2x4", [*LM_FLOP_CHECK, "--config.model.num_decoder_layers=2"]),
    ("h100:8", ["--config.model.attention_impl=xla"])])
def test_the_124m_language_model_compiles_with_the_formulas_flops(plugins, tmp_path, topology,
                                                                   extra):
  """configs/lm_gpt2_small.py (64 rows x 1,024 tokens, 50,304-piece vocabulary): whole (12
  layers) on the GPU target, its train step fits; on the TPU, with 2 of its layers unrolled
  (each compiled apart: 12 took a minute, 4 half of that), XLA's FLOP count is the
  decoder-only formula's within 10%. XLA gives no count for a GPU target."""
  result, report = _aot(plugins, "--topology", topology, "--programs", "train", *extra,
                        config="configs/lm_gpt2_small.py", json_path=tmp_path / "lm.json")
  assert result.returncode == 0, result.stderr[-3000:]
  assert report["fits"] and (report["batch_size"], report["max_len"]) == (64, 1024)
  assert report["vocab_size"] == 50_257
  train = report["programs"]["train"]
  params = report["params_bytes_per_device"] * report["mesh"]["fsdp"] * report["mesh"]["tensor"]
  layers = 2 if topology.startswith("v5e") else 12  # 7.1M parameters a layer.
  assert 120e6 - (12 - layers) * 7.09e6 < params / 4 < 130e6 - (12 - layers) * 7.09e6
  if topology.startswith("v5e"):
    assert 0.9 <= train["xla_over_analytic"] <= 1.1, train
  else:  # A device's logits and their gradient in bfloat16, no float32 copy: 2 x 0.77 GiB.
    assert train["step_shape"]["vocab_arrays"] == {
        "bf16[8,1024,50304]": {"count": 1, "bytes": 8 * 1024 * 50304 * 2},
        "bf16[8192,50304]": {"count": 1, "bytes": 8 * 1024 * 50304 * 2}}


def test_a_run_that_cannot_install_the_plugins_skips_their_tests_in_one_line(tmp_path):
  """No plugins and no package index (pip offline): the tests that need them are skipped, and
  the summary says which and why in one line."""
  env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path),
             **{targets.PLUGINS_ENV: str(tmp_path / "no-plugins")})
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/system/test_aot.py",
       "-k", "compiles_for_a_tpu_topology or compiles_for_h100 or scatters_are_counted"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:]
  skipped = [line for line in result.stdout.splitlines() if line.startswith("skipped")]
  assert len(skipped) == 1, result.stdout[-3000:]
  assert skipped[0].startswith(
      "skipped 2 (tests/system/test_aot.py::test_the_smoke_config_compiles_for_a_tpu_topology, "
      "tests/system/test_aot.py::test_the_smoke_config_compiles_for_h100): aot's compiler "
      f"plugins are not in {tmp_path / 'no-plugins'} and could not be installed (`python -m "
      "transformer_jax aot --install_plugins`: "), skipped
  assert "libtpu" in skipped[0], skipped  # pip's own reason.
  assert "1 passed, 2 skipped" in result.stdout
