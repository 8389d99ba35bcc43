"""Train-step throughput and model-FLOPs utilisation, using the library's own train_step.

  python benchmarks/train_step.py --config configs/fra_eng.py --data_dir data/fra-eng
      [--batches packed,padded,random] [--batch_tokens 2304] [--steps 20] [--json out.json]

Batches (`--batches`, default `packed`): `packed`, what train.py trains on (the config's
corpus through the real pipeline, first-fit packed rows); `padded`, the same corpus one sentence
a row; `random`, full rows of uniform random token ids, a control only: real text's ids collide
(a few ids are most tokens), and a step whose cost follows the ids (a scatter-add's atomics on a
GPU) looks faster on random ones than it trains. `--real_data` is `--batches packed,padded`.

Prints a table and optionally writes JSON: device, compile time, the ahead-of-time memory
report, median and p90 step time (a wait after each step) and the pipelined step time (steps
queued back to back, as the training loop runs them), tokens/s (real tokens only, and with
padding), model FLOPs per step (formula in benchmarks/README.md), achieved FLOP/s, and
utilisation against a large matrix product timed on the same device in the same run and against
the vendor's peak where the device is known.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.common import load_config  # noqa: E402
from transformer_jax import config as config_lib, sharding  # noqa: E402
from transformer_jax.models import build
from transformer_jax.training import steps as step_lib
from transformer_jax.models.flops import model_flops, peak_flops, segment_lengths  # noqa: E402,F401



def matmul_rate(dtype, n: int | None = None, repeats: int = 10) -> tuple[float, int]:
  """(FLOP/s, n) of an n x n x n product of random matrices in `dtype` on the default device;
  n defaults to 4096 on a CPU and 8192 on an accelerator (large enough to fill it)."""
  n = n or (4096 if jax.default_backend() == "cpu" else 8192)
  a, b = (jax.random.normal(key, (n, n), dtype) for key in jax.random.split(jax.random.key(0)))
  f = jax.jit(lambda x, y: x @ y)
  jax.block_until_ready(f(a, b))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(a, b))
    times.append(time.perf_counter() - start)
  return 2 * n ** 3 / float(np.median(times)), n


def synthetic_batch(rows: int, length: int, vocab: int, seed: int = 0):
  """Full rows of random tokens, one sentence each."""
  rng = np.random.default_rng(seed)
  seg = np.ones((rows, length), np.int32)
  pos = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
  tok = lambda: rng.integers(4, vocab, (rows, length)).astype(np.int32)
  return {"inputs": tok(), "decoder_inputs": tok(), "targets": tok(), "inputs_segment_ids": seg,
          "targets_segment_ids": seg, "inputs_positions": pos, "targets_positions": pos}


def config_batch(config, rows: int | None = None, seed: int = 0):
  """synthetic_batch at the config's length and vocabulary (default rows: its batch size),
  with only one side's features where the model has one (decoder-only, encoder-only)."""
  from transformer_jax.data.packing import LM_FEATURES
  data = config.data
  batch = synthetic_batch(rows or data.batch_size, data.max_len, data.vocab_size, seed)
  if config.model.family != "encoder_decoder":
    batch = {k: batch[k] for k in LM_FEATURES}
  return batch


def real_batches(config, rows: int, packing: bool, count: int):
  """Batches from the real pipeline of the config's dataset (packed, or padded to max_len)."""
  import tempfile
  from transformer_jax.data import pipeline  # tfds loads only for real data.
  with tempfile.TemporaryDirectory() as workdir:
    data = pipeline.prepare(config_lib.parse(config).data, workdir)
  stream = pipeline.pair_stream(data.train, batch_size=rows, max_len=config.data.max_len,
                                overlong=config.data.overlong, seed=0, pack=packing)
  batches = [next(stream) for _ in range(count)]
  stream.close()
  return batches


def batch_cases(config, names: list[str], rows: int, count: int = 8) -> dict[str, list]:
  """{name: batches} for `names` from packed, padded (the config's corpus) and random."""
  cases = {}
  for name in names:
    if name == "random":
      cases[name] = [synthetic_batch(rows, config.data.max_len, config.data.vocab_size)]
    else:
      cases[name] = real_batches(config, rows, name == "packed", count)
  return cases


def train_setup(config, mesh=None, masking=None):
  """The library's own model, sharded train state and jitted train step for `config` (source and
  target vocabulary: config.data.vocab_size), on `mesh` (default: the config's mesh), a masked
  language model's step drawing its masks by `masking` (steps.Masking).

  Returns:
    (model config, mesh, state, jitted train_step)
  """
  c = config_lib.parse(config)
  mesh = mesh or sharding.make_mesh(c.run.mesh_shape)
  cfg = build.model_config(c.model, c.data.vocab_size, c.data.vocab_size,
                              max_len=c.data.max_len)
  model = build.build_model(cfg)
  state, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(c.optimizer, c.run.num_steps, model), 0, mesh,
      c.data.max_len, ema=c.eval_params_kept)
  p_train, _ = step_lib.jit_steps(shardings, mesh, c.step, masking)
  return cfg, mesh, state, p_train


def benchmark(config, batches, steps: int, warmup: int = 2) -> dict:
  cfg, mesh, state, p_train = train_setup(config)
  with sharding.mesh_context(mesh):
    global_batches = [sharding.global_batch(b, mesh) for b in batches]
    start = time.perf_counter()
    compiled = p_train.lower(state, global_batches[0]).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    for i in range(warmup):
      state, metrics = compiled(state, global_batches[i % len(batches)])
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
      start = time.perf_counter()
      state, metrics = compiled(state, global_batches[i % len(batches)])
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    # As the training loop runs: steps queued back to back, one wait at the end (on a GPU the
    # host then launches step i+1 while step i runs).
    start = time.perf_counter()
    for i in range(steps):
      state, metrics = compiled(state, global_batches[i % len(batches)])
    jax.block_until_ready(metrics)
    pipelined = (time.perf_counter() - start) / steps
  median, p90 = float(np.median(times)), float(np.percentile(times, 90))
  mean = lambda key: float(np.mean([(b[key] > 0).sum() for b in batches]))  # real tokens
  flops = float(np.mean([model_flops(cfg, segment_lengths(b["inputs_segment_ids"]),
                                     segment_lengths(b["targets_segment_ids"]))
                         for b in batches]))
  rows, length = batches[0]["targets"].shape
  return {
      "compile_s": compile_s, "median_step_s": median, "p90_step_s": p90,
      "pipelined_step_s": pipelined,
      "real_tgt_tokens_per_s": mean("targets_segment_ids") / median,
      "pipelined_real_tgt_tokens_per_s": mean("targets_segment_ids") / pipelined,
      "real_src_tokens_per_s": mean("inputs_segment_ids") / median,
      "padded_tokens_per_s": rows * length / median,
      "padding_fraction": 1.0 - mean("targets_segment_ids") / (rows * length),
      "model_flops_per_step": flops, "achieved_flops_per_s": flops / median,
      "pipelined_flops_per_s": flops / pipelined,
      "memory": {k: getattr(memory, k, None) for k in (
          "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
          "generated_code_size_in_bytes")} if memory is not None else None,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/fra_eng.py")
  parser.add_argument("--batch_tokens", type=int, default=0,
                      help="tokens a side per batch (rows = batch_tokens // max_len)")
  parser.add_argument("--max_len", type=int, default=0)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batches", default="packed",
                      help="comma-separated: packed, padded (the config's corpus), random "
                      "(uniform random ids, a control)")
  parser.add_argument("--real_data", action="store_true", help="the same as --batches "
                      "packed,padded")
  parser.add_argument("--data_dir", default=None, help="the corpus's local files (default: "
                      "the config's data.data_dir; empty: download)")
  parser.add_argument("--tfds_dir", default=None, help="where tfds prepares the corpus "
                      "(default: the config's data.tfds_dir)")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="config override, e.g. --set model.scan_layers=True")
  parser.add_argument("--matmul_n", type=int, default=0, help="the size of the reference "
                      "matrix product (default: 4096 on a CPU, 8192 on an accelerator)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  names = ["packed", "padded"] if args.real_data else [
      n.strip() for n in args.batches.split(",") if n.strip()]
  if not names or set(names) - {"packed", "padded", "random"}:
    parser.error(f"--batches {args.batches!r}: choose from packed, padded, random")

  config = load_config(args.config, args.set)
  if args.max_len:
    config.data.max_len = args.max_len
  if args.batch_tokens:
    config.data.batch_size = max(1, args.batch_tokens // config.data.max_len)
  rows = config.data.batch_size
  dtype = jnp.dtype(config.model.dtype)
  device = jax.devices()[0]
  matmul, matmul_n = matmul_rate(dtype, args.matmul_n or None)
  peak = peak_flops(device.device_kind)
  if args.data_dir is not None:
    config.data.data_dir = args.data_dir
  if args.tfds_dir is not None:
    config.data.tfds_dir = args.tfds_dir
  cases = batch_cases(config, names, rows)
  results = {name: benchmark(config, batches, args.steps) for name, batches in cases.items()}

  cpu = cpu_model()
  print(f"device: {device.device_kind} x{jax.device_count()} ({cpu}, {os.cpu_count()} cores), "
        f"jax {jax.__version__}; config {args.config}: d_model {config.model.d_model}, "
        f"embedding gradient {config.model.embed_grad}, "
        f"{config.model.num_encoder_layers}+{config.model.num_decoder_layers} layers, "
        f"{rows} x {config.data.max_len} tokens a side, {config.model.dtype}")
  print(f"matrix product rate ({dtype.name}, {matmul_n}^3): {matmul / 1e9:.1f} GFLOP/s"
        + (f"; vendor peak {peak / 1e12:.0f} TFLOP/s" if peak else ""))
  for name, r in results.items():
    r["mfu_vs_matmul"] = r["achieved_flops_per_s"] / matmul
    r["mfu_vs_peak"] = r["achieved_flops_per_s"] / peak if peak else None
    r["pipelined_mfu_vs_matmul"] = r["pipelined_flops_per_s"] / matmul
    r["pipelined_mfu_vs_peak"] = r["pipelined_flops_per_s"] / peak if peak else None
    label = f"{name}, control: uniform random ids" if name == "random" else name
    print(f"[{label}] compile {r['compile_s']:.1f} s | step median {r['median_step_s'] * 1e3:.1f}"
          f" ms, p90 {r['p90_step_s'] * 1e3:.1f} ms, pipelined {r['pipelined_step_s'] * 1e3:.1f} ms"
          f" ({r['pipelined_mfu_vs_matmul']:.1%} of matmul) | real target tokens/s "
          f"{r['real_tgt_tokens_per_s']:.0f} (pipelined {r['pipelined_real_tgt_tokens_per_s']:.0f})"
          f", source {r['real_src_tokens_per_s']:.0f}, with "
          f"padding {r['padded_tokens_per_s']:.0f} (padding {r['padding_fraction']:.1%}) | "
          f"{r['model_flops_per_step'] / 1e9:.1f} GFLOP/step, "
          f"{r['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = {r['mfu_vs_matmul']:.1%} of matmul"
          + (f", {r['mfu_vs_peak']:.1%} of peak" if peak else ""))
    if r["memory"]:
      print(f"[{name}] memory (AOT): " + ", ".join(
          f"{k.replace('_size_in_bytes', '')} {v / 2**20:.1f} MiB"
          for k, v in r["memory"].items() if v is not None))
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"device": device.device_kind, "device_count": jax.device_count(), "config": args.config,
         "matmul_flops_per_s": matmul, "matmul_n": matmul_n,
         "peak_flops_per_s": peak, "results": results}, indent=2))


if __name__ == "__main__":
  main()
