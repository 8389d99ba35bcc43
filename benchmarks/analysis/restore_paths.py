"""What reading a checkpoint's parameters onto an accelerator costs in a new process, the two
ways `Checkpointer.restore_params` has: orbax placing each array on the devices as it reads it,
verified by fingerprints computed there (`per_array`), or every array read into this host's
memory, verified there, and the whole tree put onto the devices at once (`via_host`, the
default on an accelerator). Run one way per process (the first restore of a process is what a
command pays), alternating; each restore's seconds run until the parameters are on the
devices. Also prints the process's first `jax.devices()` (the backend's start). Usage:
  python benchmarks/analysis/restore_paths.py WORKDIR --way per_array|via_host [--rounds 2]
      [--json FILE]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

START = time.perf_counter()
DEVICES = jax.devices()
BACKEND_START = time.perf_counter() - START

from transformer_jax import sharding  # noqa: E402
from transformer_jax.models.trained import abstract_params, open_run  # noqa: E402
from transformer_jax.workdir import Workdir  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--way", choices=("per_array", "via_host"), required=True)
  parser.add_argument("--rounds", type=int, default=2, help="restores in this process")
  parser.add_argument("--json", help="also write the figures to this file")
  args = parser.parse_args()
  run = Workdir(args.workdir)
  _, _, model = open_run(run)
  mesh = sharding.make_mesh((-1, 1, 1))
  abstract = abstract_params(model)
  ckpt = run.checkpointer(read_only=True)
  step = ckpt.manager.latest_step()
  seconds = []
  for _ in range(args.rounds):
    start = time.perf_counter()
    params = jax.block_until_ready(
        ckpt.restore_params(step, abstract, mesh, via_host=args.way == "via_host"))
    seconds.append(round(time.perf_counter() - start, 3))
  ckpt.close()
  leaves = jax.tree.leaves(params)
  figures = {"way": args.way, "devices": [str(d) for d in DEVICES],
             "backend_start_s": round(BACKEND_START, 3), "arrays": len(leaves),
             "bytes": sum(x.nbytes for x in leaves),
             "on": sorted({d.platform for x in leaves for d in x.devices()}),
             "restore_s": seconds}
  print(json.dumps(figures), flush=True)
  if args.json:
    with open(args.json, "a") as f:
      f.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
  main()
