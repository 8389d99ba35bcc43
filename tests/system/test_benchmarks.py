"""The benchmark scripts' arithmetic and bookkeeping (no timing is asserted)."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import common, profile_step, train_step
from tests.conftest import ROOT
from transformer_jax.models.common import TransformerConfig


def test_model_flops_follows_the_documented_formula():
  cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=4, num_heads=1,
                          ffn_dim=8, num_encoder_layers=1, num_decoder_layers=1,
                          share_embeddings=True, tie_output=True)
  # One sentence, source 3 and target 2 tokens; benchmarks/README.md's terms by hand:
  encoder = (8 * 16 + 4 * 4 * 8) * 3 + 4 * 4 * 9  # QKVO + FFN; scores and values
  decoder = (12 * 16 + 4 * 4 * 8) * 2 + 4 * 16 * 3 + 2 * 4 * 4 + 4 * 4 * 6
  output = 2 * 4 * 10 * 2
  got = train_step.model_flops(cfg, np.array([3]), np.array([2]))
  assert got == 3 * (encoder + decoder + output)
  # Packed sentences attend only within themselves: two 2-token sentences cost less attention
  # than one 4-token sentence, the same projections.
  packed = train_step.model_flops(cfg, np.array([2, 2]), np.array([2, 2]))
  single = train_step.model_flops(cfg, np.array([4]), np.array([4]))
  assert packed < single


def test_a_language_models_flops_have_no_cross_attention():
  from transformer_jax.models import flops
  cfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=10, d_model=4, num_heads=1,
                          ffn_dim=8, num_encoder_layers=0, num_decoder_layers=2,
                          family="decoder_only")
  # Two documents of 3 and 2 tokens: per layer QKVO + FFN and the causal half of the scores.
  layer = (8 * 16 + 4 * 4 * 8) * 5 + 2 * 4 * (9 + 4)
  output = 2 * 4 * 10 * 5
  assert flops.model_flops(cfg, np.zeros(0), np.array([3, 2])) == 3 * (2 * layer + output)
  batch = {"targets_segment_ids": np.array([[1, 1, 1, 2, 2, 0]])}
  assert flops.batch_flops(cfg, batch) == 3 * (2 * layer + output)


def test_load_config_applies_overrides_and_rejects_unknown_fields():
  config = common.load_config("configs/fra_eng.py", ["model.d_model=512", "data.batch_size=7",
                                                     "model.attention_impl=xla"])
  assert (config.model.d_model, config.data.batch_size, config.model.attention_impl) == (
      512, 7, "xla")
  with pytest.raises(ValueError, match="no field 'model.no_such_field'"):
    common.load_config("configs/fra_eng.py", ["model.no_such_field=1"])
  with pytest.raises(TypeError):
    common.load_config("configs/fra_eng.py", ["model.d_model='wide'"])
  with pytest.raises(ValueError, match="FIELD=VALUE"):
    common.load_config("configs/fra_eng.py", ["model.d_model"])


def test_real_batches_count_real_tokens_packed_and_padded(smoke_config):
  smoke_config.data.batch_size = 8
  results = {}
  for packing in (True, False):
    batches = train_step.real_batches(smoke_config, 8, packing, count=2)
    results[packing] = train_step.benchmark(smoke_config, batches, steps=2, warmup=1)
  for r in results.values():
    assert 0.0 <= r["padding_fraction"] < 1.0
    assert r["real_tgt_tokens_per_s"] <= r["padded_tokens_per_s"]
    assert r["model_flops_per_step"] > 0 and r["memory"]["temp_size_in_bytes"] > 0
    assert r["pipelined_step_s"] > 0
  # Packing fills rows: less padding, more sentences (so more useful FLOPs) a batch.
  assert results[True]["padding_fraction"] < results[False]["padding_fraction"]
  assert results[True]["model_flops_per_step"] > results[False]["model_flops_per_step"]


def test_benchmarks_and_decoding_import_without_tfds_grain_or_clu():
  """The accelerator machines lack tfds, grain and clu: the benchmarks and the translate command
  must import without them (the data pipeline loads only for real batches and training), and
  a workdir's source language (translate asks for it) and a config's check (aot's) read the
  datasets' catalog without tfds, which would add 0.4 s to each command's start."""
  script = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in {"tensorflow", "tensorflow_datasets", "grain", "clu"}:
      raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import benchmarks.train_step, benchmarks.decode, benchmarks.compare_pytorch
import benchmarks.profile_step, benchmarks.step_variants, benchmarks.token_ids
import transformer_jax.decoding.translator, transformer_jax.decoding.heatmaps
from types import SimpleNamespace
from configs import fra_eng
from transformer_jax.training import checks
workdir = SimpleNamespace(config=SimpleNamespace(data=SimpleNamespace(dataset="fra_eng")))
print(transformer_jax.decoding.translator.Translator.src_lang.fget(workdir),
      checks.validated(fra_eng.get_config("smoke")).data.dataset)
try:
  import transformer_jax.data.sources
except ImportError as e:
  print(e)
"""
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines() == ["en fra_eng",
                                     "blocked: tensorflow_datasets"]  # The blocker works.


def test_profile_sums_each_kernel_per_device_timeline(tmp_path):
  events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 1, "name": "gemm", "dur": 5},
            {"ph": "X", "pid": 1, "name": "gemm", "dur": 7},
            {"ph": "X", "pid": 1, "name": "softmax", "dur": 2},
            {"ph": "X", "pid": 2, "name": "gemm", "dur": 100},
            {"ph": "X", "pid": 2, "name": "$profiler.py:271 stop_trace", "dur": 500},
            {"ph": "i", "pid": 1, "name": "marker"}]
  trace = tmp_path / "t.perfetto_trace.json.gz"
  with gzip.open(trace, "wt") as f:
    json.dump({"traceEvents": events}, f)
  labels = {}
  got = profile_step.kernel_times(trace, labels)
  assert got == {"/device:GPU:0": {"gemm": 12, "softmax": 2}, "/host:CPU": {"gemm": 100}}
  assert profile_step.buckets(got["/device:GPU:0"], labels, steps=2) == {
      "optimizer": {"ms_a_step": 0.0, "share": 0.0}, "rng": {"ms_a_step": 0.0, "share": 0.0},
      "attention": {"ms_a_step": 0.0, "share": 0.0},
      "gemm": {"ms_a_step": 0.006, "share": round(12 / 14, 4)},
      "reductions": {"ms_a_step": 0.001, "share": round(2 / 14, 4)},
      "elementwise": {"ms_a_step": 0.0, "share": 0.0}, "other": {"ms_a_step": 0.0, "share": 0.0}}


@pytest.mark.parametrize("name,label,bucket", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "", "attention"),
    ("input_reduce_fusion_3", "", "reductions"),
    ("loop_multiply_fusion_12", "jit(train_step)/optax/adam/mul", "optimizer"),
    ("loop_convert_fusion", "", "elementwise"),
    ("memcpy", "", "other")])
def test_profile_puts_each_kernel_in_one_bucket(name, label, bucket):
  assert profile_step.bucket_of(name, label) == bucket


def test_step_variants_reports_each_variants_memory_and_time(tmp_path):
  out = tmp_path / "v.json"
  result = subprocess.run(
      [sys.executable, "benchmarks/step_variants.py", "--config", "configs/fra_eng.py:smoke",
       "--steps", "2", "--variant", "step.loss_chunks=1", "--variant",
       "step.grad_accum_steps=2,step.loss_chunks=4", "--json", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  got = json.loads(out.read_text())["results"]
  assert list(got) == ["step.loss_chunks=1", "step.grad_accum_steps=2,step.loss_chunks=4"]
  for r in got.values():
    assert r["memory"]["temp_size_in_bytes"] > 0 and len(r["step_s"]) == 2
  plain = got["step.loss_chunks=1"]
  assert plain["temp_ratio"] == 1.0 and plain["step_ratio"] == 1.0
  # Half the rows at a time, a quarter of their logits at a time.
  assert got["step.grad_accum_steps=2,step.loss_chunks=4"]["temp_ratio"] < 0.8
  bad = subprocess.run(
      [sys.executable, "benchmarks/step_variants.py", "--config", "configs/fra_eng.py:smoke",
       "--aot_only", "--variant", "step.loss_chunks=5"], cwd=ROOT, capture_output=True, text=True)
  assert bad.returncode != 0
  assert "step.loss_chunks=5 must divide data.max_len=32" in bad.stderr


def test_token_id_probe_builds_its_batches_from_real_text(smoke_config):
  """Each kind changes one property of the real packed batches; all share one shape."""
  from benchmarks import token_ids
  smoke_config.data.num_workers = "0"
  got = token_ids.probe_batches(smoke_config, count=2)
  assert list(got) == list(token_ids.BATCHES)
  packed, padded = got["packed"][0], got["one_per_row"][0]
  shape = (smoke_config.data.batch_size, smoke_config.data.max_len)
  for kind, batches in got.items():
    assert len(batches) == 2 and all(b["targets"].shape == shape for b in batches), kind
  assert packed["targets_segment_ids"].max() > 1 and padded["targets_segment_ids"].max() == 1
  random_packed = got["random_packed"][0]  # Same segments, other ids, same padding.
  np.testing.assert_array_equal(random_packed["targets_segment_ids"],
                                packed["targets_segment_ids"])
  np.testing.assert_array_equal(random_packed["targets"] > 0, packed["targets"] > 0)
  assert (random_packed["targets"] != packed["targets"]).mean() > 0.9
  full = got["repeated_pad"][0]  # Padding turned into one repeated id, one segment a row.
  assert (full["targets_segment_ids"] == 1).all() and (full["targets"] > 0).all()
  pad = padded["targets"] == 0
  assert (full["targets"][pad] == 5).all()
  np.testing.assert_array_equal(full["targets"][~pad], padded["targets"][~pad])
  assert (got["random_full"][0]["targets_segment_ids"] == 1).all()


def test_token_ids_times_each_variant_on_every_kind_of_batch(tmp_path, smoke_config):
  out = tmp_path / "t.json"
  result = subprocess.run(
      [sys.executable, "benchmarks/token_ids.py", "--config", "configs/fra_eng.py:smoke",
       "--data_dir", smoke_config.data.data_dir, "--tfds_dir", smoke_config.data.tfds_dir,
       "--set", "data.num_workers='0'", "--variant", "model.embed_grad=scatter",
       "--variant", "model.embed_grad=sorted", "--batches", "1", "--repeats", "2",
       "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  got = json.loads(out.read_text())
  assert list(got["results"]) == ["model.embed_grad=scatter", "model.embed_grad=sorted"]
  for row in got["results"].values():
    assert list(row) == ["packed", "one_per_row", "random_packed", "repeated_pad",
                         "random_full"]
    assert all(r["steps"] == 2 and r["median_ms"] > 0 for r in row.values())
  assert "| model.embed_grad=sorted |" in result.stdout


def test_train_step_defaults_to_packed_text_and_labels_the_random_control(tmp_path,
                                                                          smoke_config):
  out = tmp_path / "s.json"
  result = subprocess.run(
      [sys.executable, "benchmarks/train_step.py", "--config", "configs/fra_eng.py:smoke",
       "--data_dir", smoke_config.data.data_dir, "--tfds_dir", smoke_config.data.tfds_dir,
       "--set", "data.num_workers='0'", "--steps", "2", "--json", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert list(json.loads(out.read_text())["results"]) == ["packed"]
  result = subprocess.run(
      [sys.executable, "benchmarks/train_step.py", "--config", "configs/fra_eng.py:smoke",
       "--batches", "random", "--steps", "2"], cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "[random, control: uniform random ids]" in result.stdout
  bad = subprocess.run([sys.executable, "benchmarks/train_step.py", "--batches", "zipf"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and "--batches 'zipf': choose from packed, padded, random" in bad.stderr


@pytest.mark.parametrize("part,existing", [("lm", "lm_gpt2_small/checkpoints"), ("lm_peer", "tfds")])
def test_gpu_script_refuses_an_out_dir_whose_paths_a_part_would_remove(tmp_path, part, existing):
  # The parts that train into OUT_DIR delete their checkpoints and data there at the end.
  kept = tmp_path / existing / "kept.txt"
  kept.parent.mkdir(parents=True)
  kept.write_text("a user's file")
  result = subprocess.run(["bash", "benchmarks/run_gpu.sh", str(tmp_path), part], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 98, result.stderr
  assert f"{existing.split('/')[0]} exists: PART {part} makes it" in result.stderr
  assert kept.read_text() == "a user's file"
  assert sorted(p.name for p in tmp_path.iterdir()) == [existing.split("/")[0]]


def test_gpt2_step_times_ours_and_each_variant_on_the_same_batches(tmp_path):
  """The GPT-2-shape benchmark at smoke size, ours only (the PyTorch peers need the bench
  extra): every entry timed, its tokens/s from the batch's tokens; a bad peer is one line."""
  out = tmp_path / "g.json"
  result = subprocess.run(
      [sys.executable, "benchmarks/gpt2_step.py", "--config", "configs/lm_gpt2_small.py:smoke",
       "--set", "model.dtype=float32", "--variant",
       "model.attention_mask=lengths,data.packing=False", "--peers", "none", "--rounds", "2",
       "--steps", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
      timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(out.read_text())
  assert record["batch"] == [16, 32] and record["vocab"] == 512
  names = ["ours", "ours [model.attention_mask=lengths,data.packing=False]"]
  assert list(record["results"]) == names
  for name in names:
    r = record["results"][name]
    assert len(record["step_seconds"][name]) == 2
    assert r["tokens_per_sec"] == pytest.approx(16 * 32 / (r["median_step_ms"] / 1e3), rel=0.01)
  bad = subprocess.run([sys.executable, "benchmarks/gpt2_step.py", "--peers", "jit"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert bad.returncode == 1 and bad.stderr.strip() == (
      "error: --peers 'jit': choose from compiled, eager, none")


@pytest.mark.parametrize("config", ["configs/lm_shakespeare.py:smoke",
                                    "configs/mlm_shakespeare.py:smoke"])
def test_the_pytorch_race_runs_each_familys_peer_and_profiles_both(config, tmp_path,
                                                                   monkeypatch):
  """compare_pytorch.py for a language model and a masked one (the encoder-decoder runs in
  run_gpu.sh's dry parts): both sides start at chance on the same batch, are timed in turn,
  and are profiled by the same buckets."""
  pytest.importorskip("torch")
  from benchmarks import compare_pytorch
  out = tmp_path / "race.json"
  monkeypatch.setattr(sys, "argv", ["compare_pytorch.py", "--config", config, "--rounds", "1",
                                    "--steps", "1", "--profile", "1", "--json", str(out)])
  compare_pytorch.main()
  record = json.loads(out.read_text())
  assert set(record["first_loss"]) == {"jax", "torch"}
  for loss in record["first_loss"].values():  # 500 pieces (and a mask id) padded to 512.
    assert abs(loss - np.log(512)) < 1.0
  assert record["ratio"] == pytest.approx(record["median_s"]["torch"] / record["median_s"]["jax"])
  for side in ("jax", "torch"):
    buckets = record["profile"][side]
    assert set(buckets) == {"optimizer", "rng", "attention", "gemm", "reductions",
                            "elementwise", "other"}
    assert buckets["gemm"]["ms_a_step"] > 0 and buckets["optimizer"]["ms_a_step"] > 0
    assert sum(b["share"] for b in buckets.values()) == pytest.approx(1.0, abs=0.01)


def test_recipe_sweep_trains_each_recipe_in_turn_and_reads_finished_ones(tmp_path, tfds_dir,
                                                                        cache_dir,
                                                                        fra_eng_builder):
  from tests.conftest import DATA
  out = tmp_path / "sweep"
  command = [sys.executable, "benchmarks/recipe_sweep.py", "--out", str(out), "--data_dir",
             str(DATA / "fra-eng"), "--config", "configs/fra_eng.py:smoke", "--steps", "4",
             "--eval_every", "2", "--common", f"data.tfds_dir={tfds_dir};"
             f"run.compilation_cache_dir={cache_dir};eval.bleu_sentences=8;data.num_workers=0",
             "--recipes", "muon,broken=model.num_heads=0"]
  first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  sweep = json.loads((out / "sweep.json").read_text())
  by_name = {r["name"]: r for r in sweep["recipes"]}
  assert [r["name"] for r in sweep["recipes"]] == ["muon", "broken"]
  for name in ("muon",):  # One recipe trained: the suite's budget.
    assert by_name[name]["returncode"] == 0
    assert [p["step"] for p in by_name[name]["curve"]] == [2, 4]
    seconds = [p["seconds"] for p in by_name[name]["curve"]]
    assert 0 < seconds[0] <= seconds[1] <= by_name[name]["wall_seconds"]
  assert by_name["muon"]["overrides"] == ["optimizer.name=muon"]
  assert json.loads((out / "muon" / "config.json").read_text())["optimizer"]["name"] == "muon"
  assert by_name["broken"]["returncode"] != 0 and not by_name["broken"]["curve"]
  assert "model.num_heads=0 must be a positive integer" in (out / "broken.log").read_text()
  assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  again = subprocess.run(command[:-1] + ["muon"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "[muon] --config" not in again.stdout  # Finished runs are read, not trained again.
  assert json.loads((out / "sweep.json").read_text())["recipes"][0] == by_name["muon"]
