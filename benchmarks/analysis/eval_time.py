"""Seconds each in-training evaluation took (from the step line to the evaluation's log line),
their sum, and the first log line to the pipeline's "pairs kept" line, from a training log.
Usage: python benchmarks/analysis/eval_time.py rD_train_log.txt ..."""
import datetime
import re
import sys


def stamp(line):
  return datetime.datetime.strptime(line.split()[1], "%H:%M:%S.%f")


for path in sys.argv[1:]:
  lines = open(path).read().splitlines()
  steps, evals, ready = {}, {}, None
  for line in lines:
    if m := re.search(r"Step (\d+) of", line):
      steps[int(m.group(1))] = stamp(line)
    elif m := re.search(r"\[(\d+)\] eval/accuracy", line):
      evals[int(m.group(1))] = stamp(line)
    elif "pairs kept" in line:
      ready = stamp(line)
  took = {s: (evals[s] - steps[s]).total_seconds() for s in sorted(evals) if s in steps}
  print(path, " ".join(f"{s}:{t:.0f}s" for s, t in took.items()),
        f"| sum {sum(took.values()):.0f} s | to pipeline ready {(ready - stamp(lines[0])).total_seconds():.0f} s")
