"""Seconds from a train.py command to its first train step, and its peak memory.

  python benchmarks/first_step.py --json out.json -- \
      --config configs/synthetic.py:cpu --workdir /tmp/w --config.data_dir /tmp/synth5m \
      --config.tfds_dir /tmp/synth5m/tfds --config.num_steps 1

Runs `train.py ARGS --config.log_every=1`, and reports: when the step-1 metrics line appeared
(seconds after the start), the peak resident memory of the train.py process (VmHWM, polled
from /proc until it exits) and of its grain workers, and the exit status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_kib(pid: int) -> int:
  """VmHWM of a live process in KiB (0 once it has gone)."""
  try:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return int(line.split()[1])
  except (FileNotFoundError, ProcessLookupError):
    pass
  return 0


def children(pid: int) -> list[int]:
  try:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
  except FileNotFoundError:
    return []


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json")
  parser.add_argument("train_args", nargs=argparse.REMAINDER)
  args = parser.parse_args()
  train_args = [a for a in args.train_args if a != "--"]
  cmd = [sys.executable, "train.py", *train_args, "--config.log_every=1"]
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  first_step, lines = None, []

  def read():
    nonlocal first_step
    for line in proc.stdout:
      lines.append(line)
      if first_step is None and "] steps_per_sec=" in line and "[1] " in line:
        first_step = time.perf_counter() - start
        print(f"first step logged after {first_step:.1f} s", flush=True)

  reader = threading.Thread(target=read)
  reader.start()
  main_peak, worker_peaks = 0, {}
  while proc.poll() is None:
    main_peak = max(main_peak, peak_kib(proc.pid))
    for child in children(proc.pid):
      worker_peaks[child] = max(worker_peaks.get(child, 0), peak_kib(child))
    time.sleep(0.2)
  reader.join()
  result = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
            "seconds_to_first_step": first_step, "wall_s": time.perf_counter() - start,
            "peak_rss_mib": main_peak / 1024,
            "child_peak_rss_mib": sorted(v / 1024 for v in worker_peaks.values())}
  print(json.dumps(result, indent=2))
  if proc.returncode:
    print("".join(lines[-40:]))
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2))
  sys.exit(proc.returncode)


if __name__ == "__main__":
  main()
