"""What loading each kept program costs: the programs a command used (a `used-*.json` list of a
program store, in the order the command first called them), each read, unpickled and loaded
(`programs._load`, as the store loads them) one after another in this process, timed by
program name. Usage:
  python benchmarks/analysis/program_loads.py DIR/programs [--list used-KEY.json] [--json FILE]
(DIR: a `translate` command's --compilation_cache_dir; default list: the store's only one.)
"""

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from transformer_jax import programs  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("programs", help="a program store's directory")
  parser.add_argument("--list", help="which used-*.json list (default: the only one)")
  parser.add_argument("--json", help="also write the figures to this file")
  args = parser.parse_args()
  store = Path(args.programs)
  lists = [store / args.list] if args.list else sorted(store.glob("used-*.json"))
  if len(lists) != 1:
    sys.exit(f"{store} holds {len(lists)} lists of programs used: name one with --list")
  names = json.loads(lists[0].read_text())
  jax.devices()  # The backend's start is not a load's.
  rows = []
  start = time.perf_counter()
  for name in names:
    t0 = time.perf_counter()
    programs._load(store / name)
    rows.append({"program": name.split("-")[0], "kb": (store / name).stat().st_size // 1024,
                 "load_ms": 1e3 * (time.perf_counter() - t0)})
  total = time.perf_counter() - start
  by_name = collections.defaultdict(list)
  for row in rows:
    by_name[row["program"]].append(row)
  print(f"{len(rows)} programs loaded in {total:.2f} s ({jax.devices()[0].platform})")
  for name, group in by_name.items():
    print(f"  {name:<14} {len(group):>2} x {sum(r['kb'] for r in group) // len(group):>4} KB: "
          f"{sum(r['load_ms'] for r in group):7.1f} ms in all, "
          + ", ".join(f"{r['load_ms']:.0f}" for r in group))
  if args.json:
    Path(args.json).write_text(json.dumps({"total_s": total, "programs": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
