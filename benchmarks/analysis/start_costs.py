"""Where a command's start goes: runs one `python -m transformer_jax COMMAND ...` in this
process and prints, when it ends, its wall time, the time to import the package, and jax's
own duration events summed over the command (tracing, lowering to StableHLO, compiling or
reading the persistent compilation cache, orbax reads), each with its count. Usage:
  python benchmarks/analysis/start_costs.py translate --workdir runs/fra_eng --input FILE ...
"""

import atexit
import collections
import sys
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jax import monitoring  # noqa: E402

seconds: dict[str, float] = collections.defaultdict(float)
counts: collections.Counter = collections.Counter()


def _record(event: str, duration: float, **_) -> None:
  seconds[event] += duration
  counts[event] += 1


def _report() -> None:
  print(f"{time.perf_counter() - START:8.2f} s  the whole command", file=sys.stderr)
  print(f"{IMPORTED - START:8.2f} s  importing the package", file=sys.stderr)
  for event in sorted(seconds, key=lambda e: -abs(seconds[e])):
    print(f"{seconds[event]:8.2f} s  {counts[event]:4d}x {event}", file=sys.stderr)


monitoring.register_event_duration_secs_listener(_record)
import transformer_jax.__main__ as front  # noqa: E402
from transformer_jax.decoding import translator  # noqa: E402, F401 -- the package's heavy imports.

IMPORTED = time.perf_counter()
atexit.register(_report)
front.END_AT_ONCE = ()  # translate's immediate exit would skip the report.
front.main()
