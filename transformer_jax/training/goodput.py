"""The goodput ledger: where a run's wall time went, over its whole life across restarts.

`WORKDIR/goodput.jsonl` holds one line for each life of the run (each process that trained
it; process 0 of a multi-host run). A life reserves its line when it opens the workdir and
rewrites it in place after every step and twenty times a second, so a kill, SIGKILL
included, loses a twentieth of a second at most. A line splits its life's wall time, from
the process's start to its last write, into BUCKETS:

  step        train steps that moved the run forward: the goodput
  recomputed  train steps done again after a kill: those up to the furthest step an earlier
              life reached (its line, or its metrics.jsonl) since the checkpoint resumed from
  compile     tracing, lowering and compiling programs, or reading them from the cache
  input       waiting for a batch
  eval        evaluation: losses, accuracy, BLEU
  save        writing checkpoints (and waiting for the last one to finish)
  restore     reading the checkpoint resumed from
  startup     the rest before the first step: imports, data and tokenizer, the model's state
  other       after the last step: closing the writers and the data workers

goodput = step / wall, over every life. `python -m transformer_jax report` prints the ledger.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from pathlib import Path

import jax
import psutil

from transformer_jax.errors import UserError

BUCKETS = ("step", "recomputed", "compile", "input", "eval", "save", "restore", "startup",
           "other")
FILE = "goodput.jsonl"
_WIDTH = 1024  # Bytes a line takes, padded: each life rewrites its own line in place.

# jax's own compile events (jax.monitoring), summed for the whole process as they happen.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compiled = [0.0]


def _on_event(event: str, seconds: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    _compiled[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_event)


def process_start() -> float:
  """When this process started (seconds since the epoch), to a clock tick where Linux's
  /proc says so (psutil's create_time adds the boot time, which Linux gives in whole
  seconds: up to a second off)."""
  try:
    with open("/proc/self/stat") as stat:  # Field 22, starttime: ticks after boot.
      ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age
  except (OSError, ValueError, IndexError, AttributeError):  # Not Linux.
    return psutil.Process().create_time()


class Ledger:
  """One life's buckets. The time goes to the bucket last `enter`ed, less what jax spends
  compiling meanwhile (which goes to `compile`). Once `open`, a thread rewrites this life's
  line every HEARTBEAT seconds, and every step does; without `open` (hosts other than the
  first) nothing is written."""

  HEARTBEAT = 0.05

  def __init__(self, started: float):
    self.started = started
    self.seconds = dict.fromkeys(BUCKETS, 0.0)
    self.bucket = "startup"
    self._mark, self._compiled_mark = started, _compiled[0]
    self._lock = threading.Lock()
    self._fd = None
    self._stop = threading.Event()
    self.earlier: list[dict] = []  # The lines of the run's earlier lives.
    self.from_step = self.step = self.reach = self.recomputed_steps = 0

  def enter(self, bucket: str) -> None:
    """From now on the time goes to `bucket`."""
    with self._lock:
      self._charge()
      self.bucket = bucket

  def enter_step(self, step: int) -> None:
    """Step `step` begins: recomputed where an earlier life had already reached it."""
    recomputed = step <= self.reach
    self.recomputed_steps += recomputed
    self.enter("recomputed" if recomputed else "step")

  def finished(self, step: int) -> None:
    """Step `step` and what followed it (evaluation, checkpoint) are done; the next wait is
    for a batch."""
    self.step = step
    self.enter("input")
    self.write()

  def _charge(self) -> None:
    now, compiled = time.time(), _compiled[0]
    spent = now - self._mark
    compiling = min(compiled - self._compiled_mark, spent)
    self.seconds["compile"] += compiling
    self.seconds[self.bucket] += spent - compiling
    self._mark, self._compiled_mark = now, compiled

  def open(self, workdir: Path, from_step: int) -> None:
    """Reserves this life's line in `workdir`'s ledger (the run resumed at `from_step`)."""
    path = Path(workdir) / FILE
    self.earlier = read(path)
    self.from_step = self.step = from_step
    self.reach = max([_metrics_reach(Path(workdir) / "metrics.jsonl")]
                     + [line["step"] for line in self.earlier])
    self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    self._offset = os.lseek(self._fd, 0, os.SEEK_END)
    self.write()
    threading.Thread(target=self._beat, daemon=True, name="goodput").start()
    atexit.register(self.close)

  def _beat(self) -> None:
    while not self._stop.wait(self.HEARTBEAT):
      self.write()

  def write(self) -> None:
    """This life's line as it stands now, in place."""
    with self._lock:
      if self._fd is None:
        return
      self._charge()
      line = json.dumps(self._record()).encode()
      if len(line) >= _WIDTH:
        raise ValueError(f"a goodput line of {len(line)} bytes does not fit in {_WIDTH}")
      os.pwrite(self._fd, line.ljust(_WIDTH - 1) + b"\n", self._offset)

  def _record(self) -> dict:
    return {"life": len(self.earlier) + 1, "host": socket.gethostname(), "pid": os.getpid(),
            "started": round(self.started, 3), "updated": round(self._mark, 3),
            "from_step": self.from_step, "step": self.step,
            "recomputed_steps": self.recomputed_steps,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}

  def goodput(self) -> float:
    """Productive step time over wall time, this life and the earlier ones."""
    with self._lock:
      self._charge()
      return summary(self.earlier + [self._record()])["goodput"]

  def close(self) -> None:
    """The time since the last bucket change charged, the line written a last time."""
    self._stop.set()
    self.write()
    with self._lock:
      if self._fd is not None:
        os.close(self._fd)
        self._fd = None


def _metrics_reach(path: Path) -> int:
  """The last step metrics.jsonl logged (0 without it)."""
  reach = 0
  if path.is_file():
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
      try:
        reach = max(reach, int(json.loads(line)["step"]))
      except (ValueError, KeyError, TypeError):
        pass  # A torn last line: a kill mid-write.
  return reach


class LedgerError(UserError, ValueError):
  """A ledger line that parses but is not one this module writes (edited by hand, say)."""


# A line's fields and their kinds, as _record writes them.
_FIELDS = {"life": int, "host": str, "pid": int, "started": float, "updated": float,
           "from_step": int, "step": int, "recomputed_steps": int, "seconds": dict}


def _kind_ok(value, kind) -> bool:
  if kind in (int, float) and isinstance(value, bool):
    return False
  return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def read(path: Path) -> list[dict]:
  """The ledger's lines, one a life, in order (none without the file). A torn line is
  skipped; a line of other fields is a LedgerError naming it."""
  if not Path(path).is_file():
    return []
  lines = []
  for number, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
    try:
      line = json.loads(raw)
    except ValueError:
      continue  # Torn by a crash of the machine (a process's kill never tears one).
    bad = ("it is not an object" if not isinstance(line, dict) else next(
        (f"its {k!r} is {line.get(k)!r}, not {kind.__name__ if kind is not dict else 'buckets'}"
         for k, kind in _FIELDS.items() if not _kind_ok(line.get(k), kind)), None))
    if bad is None and not all(_kind_ok(v, float) for v in line["seconds"].values()):
      bad = "its seconds are not numbers"
    if bad:
      raise LedgerError(f"{path} line {number} is not a goodput ledger line ({bad})")
    lines.append(line)
  return lines


def summary(lines: list[dict]) -> dict:
  """The lives' buckets added up: seconds by bucket, wall time, goodput, recomputed steps."""
  seconds = {k: sum(line["seconds"].get(k, 0.0) for line in lines) for k in BUCKETS}
  wall = sum(line["updated"] - line["started"] for line in lines)
  return {"lives": len(lines), "wall": wall, "seconds": seconds,
          "goodput": seconds["step"] / wall if wall > 0 else 0.0,
          "recomputed_steps": sum(line["recomputed_steps"] for line in lines),
          "step": max((line["step"] for line in lines), default=0)}
