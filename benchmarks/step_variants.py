"""One config's train step in several variants: AOT memory and step time, side by side.

  python benchmarks/step_variants.py --config configs/fra_eng.py \
      --variant step.loss_chunks=1 --variant step.loss_chunks=4 [--steps 10] [--json out.json]
  python benchmarks/step_variants.py --config configs/wmt14_base.py --aot_only \
      --variant data.batch_size=24 --variant step.grad_accum_steps=4

Each --variant is a comma-separated list of config overrides (FIELD=VALUE). For every variant
the library's own train step is compiled ahead of time on synthetic full rows; the table shows
XLA's memory report (temporaries, arguments, outputs) and, unless --aot_only, the step time:
the variants' steps are timed round-robin (A B A B) in one process, so that all see the same
machine load, and each one's median is given with its ratio to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import interleaved, load_config  # noqa: E402
from benchmarks.train_step import config_batch, train_setup  # noqa: E402
from transformer_jax import config as config_lib, sharding  # noqa: E402


def compiled_variant(config) -> dict:
  """The AOT-compiled train step of `config` on one synthetic batch, with its memory report and
  a function that runs one step (carrying the donated state along)."""
  _, mesh, state, p_train = train_setup(config)
  batch = config_batch(config)
  with sharding.mesh_context(mesh):
    batch = sharding.global_batch(batch, mesh)
    compiled = p_train.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  held = {"state": state}

  def step():
    held["state"], metrics = compiled(held["state"], batch)
    return metrics

  report = {k: getattr(memory, k) for k in (
      "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")}
  return {"memory": report, "step": step, "tokens": config.data.batch_size * config.data.max_len}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/fra_eng.py")
  parser.add_argument("--variant", action="append", required=True,
                      help="comma-separated FIELD=VALUE overrides; give two or more")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
  parser.add_argument("--aot_only", action="store_true", help="the memory report only")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  variants = {}
  for spec in args.variant:
    config = load_config(args.config, [s for s in spec.split(",") if s])
    try:
      config_lib.validate(config)
    except config_lib.ConfigError as e:
      sys.exit(f"error: --variant {spec}: {e}")
    variants[spec] = compiled_variant(config)
  times = {} if args.aot_only else interleaved(
      {spec: v["step"] for spec, v in variants.items()}, repeats=args.steps)

  device = jax.devices()[0]
  print(f"device: {device.device_kind} x{jax.device_count()} ({os.cpu_count()} cores), "
        f"jax {jax.__version__}; config {args.config}")
  first = next(iter(variants))
  results = {}
  for spec, v in variants.items():
    temp = v["memory"]["temp_size_in_bytes"]
    r = {"memory": v["memory"], "temp_ratio": temp / variants[first]["memory"][
        "temp_size_in_bytes"], "tokens_per_step": v["tokens"]}
    line = (f"[{spec}] temporaries {temp / 2**20:.1f} MiB ({r['temp_ratio']:.2f}x), "
            f"arguments {v['memory']['argument_size_in_bytes'] / 2**20:.1f} MiB")
    if times:
      r["step_s"] = times[spec]
      r["median_step_s"] = float(np.median(times[spec]))
      r["step_ratio"] = r["median_step_s"] / float(np.median(times[first]))
      line += (f" | step median {r['median_step_s'] * 1e3:.0f} ms ({r['step_ratio']:.3f}x), "
               f"{v['tokens'] / r['median_step_s']:.0f} tokens/s with padding")
    print(line)
    results[spec] = r
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"device": device.device_kind, "config": args.config, "steps": args.steps,
         "results": results}, indent=2))


if __name__ == "__main__":
  main()
