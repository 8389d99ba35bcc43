"""Where a command's decoding time goes, program by program: runs one `python -m
transformer_jax COMMAND ...` in this process with every call of a kept program (the decoding
slots' encode, refill, run, compact, results) timed to its end, and prints, when it ends, per
program its first calls (which load or compile it) and its later ones, with the rows and width
of each encoder batch as it runs. Waiting for each call to end serializes the lanes a little,
so the command runs slower than it would alone; the shares are what counts. Usage:
  python benchmarks/analysis/program_calls.py translate --workdir runs/fra_eng --input FILE ...
"""

import atexit
import collections
import sys
import threading
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from transformer_jax import programs  # noqa: E402

calls: list[tuple[str, bool, float]] = []  # (program, first call of its signature, seconds)
_lock = threading.Lock()
_plain_jit = programs.ProgramStore.jit


def _timed_jit(store, name, describe, fn, **jit_args):
  call = _plain_jit(store, name, describe, fn, **jit_args)
  seen = set()

  def timed(*args):
    signature = programs._signature(args)
    with _lock:
      first = signature not in seen
      seen.add(signature)
    start = time.perf_counter()
    out = jax.block_until_ready(call(*args))
    seconds = time.perf_counter() - start
    with _lock:
      calls.append((name, first, seconds))
    if name == "slots_encode":
      rows, width = args[1].shape
      print(f"encode {rows} x {width}: {1000 * seconds:.0f} ms{' (first)' if first else ''}",
            file=sys.stderr)
    return out
  timed.compile = call.compile  # Compiling (a server's warm-up) is not a call.
  return timed


def _report() -> None:
  totals: dict = collections.defaultdict(lambda: [0, 0.0])
  for name, first, seconds in calls:
    totals[name, first][0] += 1
    totals[name, first][1] += seconds
  print(f"{time.perf_counter() - START:8.2f} s  the whole command", file=sys.stderr)
  for (name, first), (count, seconds) in sorted(totals.items(), key=lambda x: -x[1][1]):
    print(f"{seconds:8.2f} s  {count:5d}x {name}{' (first calls)' if first else ''}",
          file=sys.stderr)


programs.ProgramStore.jit = _timed_jit
import transformer_jax.__main__ as front  # noqa: E402

atexit.register(_report)
front.END_AT_ONCE = ()  # translate's immediate exit would skip the report.
front.main()
