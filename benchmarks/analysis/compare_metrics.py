"""Whether two runs' metrics.jsonl agree bit for bit: every training loss, nll and gradient
norm and every evaluation scalar logged by both, up to a step. Usage:
  python benchmarks/analysis/compare_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl [--until 500]
Prints each step's verdict and exits 1 if any value differs."""

import argparse
import json
import sys

KEYS = ("train/loss", "train/nll", "train/grad_norm", "eval/")


def values(path: str, until: int) -> dict:
  """{(step, name): the value logged last for it} (a resumed run logs some steps twice)."""
  out = {}
  for line in open(path, encoding="utf-8"):
    record = json.loads(line)
    if record["step"] <= until:
      for name, value in record.items():
        if name.startswith(KEYS):
          out[record["step"], name] = value
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("a")
  parser.add_argument("b")
  parser.add_argument("--until", type=int, default=10**9)
  args = parser.parse_args()
  a, b = values(args.a, args.until), values(args.b, args.until)
  common = sorted(set(a) & set(b))
  differ = [key for key in common if a[key] != b[key]]
  for step in sorted({s for s, _ in common}):
    names = [n for s, n in common if s == step]
    bad = [n for n in names if (step, n) in differ]
    print(f"step {step}: {len(names)} values, " + (f"DIFFER: {bad}" if bad else "equal"))
  print(f"{len(common)} values compared, {len(differ)} differ")
  sys.exit(1 if differ or not common else 0)


if __name__ == "__main__":
  main()
