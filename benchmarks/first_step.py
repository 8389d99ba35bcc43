"""Seconds from a train.py command to its first train step, and its peak memory.

  python benchmarks/first_step.py --json out.json --stop_at_step 20 -- \
      --config configs/synthetic.py:cpu --workdir runs/synth --config.data.data_dir data/synth5m \
      --config.data.tfds_dir data/synth5m/tfds --config.run.num_steps 100

Runs `train.py ARGS --config.run.log_every=1`, and reports: when the step-1 metrics line appeared
(seconds after the start), the peak resident memory of the train.py process (VmHWM, polled
from /proc) and of its grain workers, and the exit status. With `--stop_at_step K` the run is
killed once step K is logged, so that the peak is that of start-up and training alone (the
final evaluation of a short run can take more memory than either).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
  parser.add_argument("--stop_at_step", type=int, default=0,
                      help="Kill the run once this step is logged (0: let it finish).")
  parser.add_argument("train_args", nargs=argparse.REMAINDER)
  args = parser.parse_args()
  train_args = [a for a in args.train_args if a != "--"]
  cmd = [sys.executable, "train.py", *train_args, "--config.run.log_every=1"]
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  first_step, stopped, lines = None, None, []

  def read():
    nonlocal first_step, stopped
    for line in proc.stdout:
      lines.append(line)
      if first_step is None and "] steps_per_sec=" in line and "[1] " in line:
        first_step = time.perf_counter() - start
        print(f"first step logged after {first_step:.1f} s", flush=True)
      if args.stop_at_step and f"[{args.stop_at_step}] steps_per_sec=" in line:
        stopped = args.stop_at_step
        os.killpg(proc.pid, signal.SIGKILL)  # The trainer and its workers.

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
            "stopped_at_step": stopped,
            "seconds_to_first_step": first_step, "wall_s": time.perf_counter() - start,
            "peak_rss_mib": main_peak / 1024,
            "child_peak_rss_mib": sorted(v / 1024 for v in worker_peaks.values())}
  print(json.dumps(result, indent=2))
  failed = proc.returncode and not stopped
  if failed:
    print("".join(lines[-40:]))
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2))
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
