"""Where a train step's time goes: the most expensive kernels of a few profiled steps, and
their time by bucket (GEMM, attention, reductions, elementwise, optimizer, other).

  python benchmarks/profile_step.py --config configs/wmt14_base.py [--steps 3] [--top 30]
      [--set FIELD=VALUE ...] [--trace_dir DIR] [--json OUT.json]

Compiles the library's own train step on a synthetic batch (as train_step.py does), records
`--steps` steps with `jax.profiler.trace`, and prints, per device in the trace, the kernels (or
XLA CPU thunks) that took the most time a step, with their share of the total. On a CPU the
host timeline also holds the executor's spans around the thunks, so its shares overlap.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchmarks.common import load_config  # noqa: E402
from benchmarks.train_step import config_batch, train_setup  # noqa: E402
from transformer_jax import sharding  # noqa: E402


def kernel_times(trace_file: Path, labels: dict | None = None) -> dict[str, collections.Counter]:
  """A perfetto trace -> {process name: Counter(event name -> total microseconds)}, without the
  Python tracer's events (names starting with `$`), which nest over the work they wait for.
  `labels`, where given, collects each event name's arguments as one lowercase string (the HLO
  op and the jax op it came from, where the profiler records them)."""
  events = json.load(gzip.open(trace_file))
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  totals = collections.defaultdict(collections.Counter)
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith("$"):
      totals[names.get(e["pid"], str(e["pid"]))][e["name"]] += e.get("dur", 0)
      if labels is not None and e["name"] not in labels:
        labels[e["name"]] = " ".join(str(v) for v in e.get("args", {}).values()).lower()
  return totals


def cpu_thunk_times(trace_file: Path) -> collections.Counter:
  """XLA:CPU's thunks in a perfetto trace -> Counter(HLO instruction -> its own microseconds):
  the executor's events of the compiled program only (not the spans around them), each less
  the thunks nested in it (a while loop's body runs inside its `while` thunk)."""
  events = json.load(gzip.open(trace_file))
  events = events["traceEvents"] if isinstance(events, dict) else events
  thunks = sorted((e for e in events if e.get("ph") == "X" and "thunk_executor" in
                   " ".join(str(v) for v in e.get("args", {}).values())),
                  key=lambda e: (e["pid"], e["tid"], e["ts"], -e.get("dur", 0)))
  totals, open_ = collections.Counter(), []  # open_: the enclosing thunks, innermost last.
  for e in thunks:
    while open_ and (open_[-1]["pid"], open_[-1]["tid"]) == (e["pid"], e["tid"]) and \
        open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
      open_.pop()
    if open_ and (open_[-1]["pid"], open_[-1]["tid"]) != (e["pid"], e["tid"]):
      open_.clear()
    totals[e["name"]] += e.get("dur", 0)
    if open_:
      totals[open_[-1]["name"]] -= e.get("dur", 0)
    open_.append(e)
  return totals


def hlo_labels(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: the jax op it came from (metadata op_name), lowercase} of a
  compiled program's text: what a CPU thunk, named by its instruction, computes."""
  return {m.group(1): m.group(2).lower() for m in re.finditer(
      r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M)}


# A kernel's bucket: the first whose words appear in its name or arguments (lowercase). The
# optimizer's kernels are told by the jax op they came from (optax's update), the others by
# the names XLA, cuBLAS/CUTLASS and cuDNN give them; PyTorch's operators (aten::...) by theirs.
BUCKETS = (("optimizer", ("optax", "adam", "clip_by_global_norm", "foreach", "optimizer")),
           ("rng", ("threefry", "bernoulli", "random_bits", "rng_bit_generator", "philox")),
           ("attention", ("fmha", "cudnn", "flash", "attention", "splash")),
           ("gemm", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "matmul", "dot", "aten::mm",
                     "addmm", "bmm", "ynn_fusion", "xnn_fusion")),
           ("reductions", ("reduce", "layer_norm", "layernorm", "softmax", "logsumexp", "nll",
                           "aten::sum")),
           ("elementwise", ("loop_", "fusion", "convert", "copy", "transpose", "select",
                            "add", "multiply", "broadcast", "iota", "aten::mul",
                            "gelu", "relu", "threshold", "dropout", "bernoulli", "where",
                            "fill", "div", "erf")))


def traced(step, steps: int, trace_dir: str) -> Path:
  """The perfetto trace of `steps` calls of `step` (each waited for), after two untraced ones
  (compilation, warm-up)."""
  for _ in range(2):
    jax.block_until_ready(step())
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(steps):
      jax.block_until_ready(step())
  return next(Path(trace_dir).rglob("*perfetto_trace.json.gz"))


def bucket_of(name: str, label: str = "") -> str:
  text = f"{name.lower()} {label}"
  return next((bucket for bucket, words in BUCKETS if any(w in text for w in words)), "other")


def buckets(totals: collections.Counter, labels: dict, steps: int) -> dict[str, dict]:
  """{bucket: {"ms_a_step", "share"}} of one timeline's kernel times."""
  out = collections.Counter()
  for name, micros in totals.items():
    out[bucket_of(name, labels.get(name, ""))] += micros
  total = sum(out.values()) or 1
  return {b: {"ms_a_step": round(out[b] / steps / 1e3, 3), "share": round(out[b] / total, 4)}
          for b in [name for name, _ in BUCKETS] + ["other"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/fra_eng.py")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--trace_dir", default=None, help="keep the trace here (default: a temp dir)")
  parser.add_argument("--json", default=None, help="write the buckets and top kernels here")
  args = parser.parse_args()
  if args.json and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):
    sys.exit(f"error: --json {args.json}: not a file in an existing directory")

  config = load_config(args.config, args.set)
  cfg, mesh, state, p_train = train_setup(config)
  data = config.data
  trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="profile_step_")
  with sharding.mesh_context(mesh):
    batch = sharding.global_batch(config_batch(config), mesh)
    holder = {"state": state}

    def step():
      holder["state"], metrics = p_train(holder["state"], batch)
      return metrics
    trace_file = traced(step, args.steps, trace_dir)

  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {args.config} "
        f"{' '.join(args.set)}; d_model {cfg.d_model}, {data.batch_size} x {data.max_len} "
        f"tokens a side, {cfg.dtype}, attention {cfg.attention_impl}; trace in {trace_dir}")
  labels = {}
  timelines = kernel_times(trace_file, labels)
  # On an accelerator, only the device's own timelines (the host's hold Python and launches).
  devices = {p: t for p, t in timelines.items() if "GPU" in p or "TPU" in p}
  record = {"command": "python benchmarks/profile_step.py " + " ".join(sys.argv[1:]),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "steps": args.steps, "timelines": {}}
  for process, totals in (devices or timelines).items():
    total = sum(totals.values())
    print(f"--- {process}: {total / args.steps / 1e3:.2f} ms of events a step")
    by_bucket = buckets(totals, labels, args.steps)
    print("  " + ", ".join(f"{b} {v['ms_a_step']:.2f} ms ({v['share']:.0%})"
                           for b, v in by_bucket.items()))
    for name, micros in totals.most_common(args.top):
      print(f"{micros / args.steps / 1e3:9.3f} ms {micros / total:6.1%}  "
            f"[{bucket_of(name, labels.get(name, ''))}] {name[:100]}")
    record["timelines"][process] = {
        "ms_a_step": round(total / args.steps / 1e3, 3), "buckets": by_bucket,
        "top": [{"name": n, "ms_a_step": round(m / args.steps / 1e3, 3),
                 "bucket": bucket_of(n, labels.get(n, ""))}
                for n, m in totals.most_common(args.top)]}
  if args.json:
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
