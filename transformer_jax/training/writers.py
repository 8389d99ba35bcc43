"""Metric writers: console, TensorBoard events and metrics.jsonl, with or without TensorFlow.

TensorBoard events come from clu's writer where TensorFlow is installed and from tensorboardX
where it is not (importing anything under `clu.metric_writers` imports TensorFlow), so
training runs on machines that cannot carry TensorFlow. metrics.jsonl gets one JSON object a
line, flushed as it is written: a killed run keeps every step it logged.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from absl import logging


def _scalar(v) -> float:
  return float(np.asarray(v))


class LoggingWriter:
  """One console line per write: `[step] name=value, ...` (clu's LoggingWriter format)."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    values = ", ".join(f"{k}={_scalar(v):.6g}" for k, v in sorted(scalars.items()))
    logging.info("[%d] %s", step, values)

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    logging.info("[%d] Got texts: %s.", step, dict(texts))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    logging.info("Hyperparameters: %s", dict(hparams))

  def flush(self) -> None: pass
  def close(self) -> None: pass


class JsonlWriter(LoggingWriter):
  """Appends every scalar or text write to a file as one JSON object a line, keyed by `step`.

  `resume_step`: the step a run resumes from. Lines of later steps (logged by a run that died
  before its next checkpoint) are dropped first, so the resumed run writes each step once.
  """

  def __init__(self, path: str | Path, resume_step: int = 0):
    path = Path(path)
    if path.exists():
      _truncate_after(path, resume_step)
    self._file = open(path, "a", encoding="utf-8")

  def _write(self, record: dict) -> None:
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()  # Into the OS at once: a SIGKILL loses nothing written.

  def write_scalars(self, step, scalars):
    self._write({"step": int(step), **{k: _scalar(v) for k, v in scalars.items()}})

  def write_texts(self, step, texts):
    self._write({"step": int(step), **texts})

  def write_hparams(self, hparams): pass

  def close(self):
    self._file.close()


def _truncate_after(path: Path, step: int) -> None:
  """Rewrites `path` (atomically) without its lines of steps after `step`; a torn last line
  (a kill mid-write) goes too."""
  kept, dropped = [], 0
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      keep = json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
      keep = False
    if keep:
      kept.append(line + "\n")
    else:
      dropped += 1
  if dropped:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    logging.info("Dropped %d lines after step %d from %s (they are logged again)", dropped,
                 step, path)


class TensorBoardXWriter(LoggingWriter):
  """TensorBoard events through tensorboardX (no TensorFlow needed)."""

  def __init__(self, logdir: str | Path):
    from tensorboardX import SummaryWriter
    self._writer = SummaryWriter(str(logdir), flush_secs=30)

  def write_scalars(self, step, scalars):
    for k, v in scalars.items():
      self._writer.add_scalar(k, _scalar(v), int(step))

  def write_texts(self, step, texts):
    for k, v in texts.items():
      self._writer.add_text(k, v, int(step))

  def write_hparams(self, hparams):
    self._writer.add_text("hparams", json.dumps(hparams, indent=1, default=str), 0)

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


class CluWriter(LoggingWriter):
  """clu's TensorBoard summary writer (TensorFlow's), without its console output."""

  def __init__(self, logdir: str | Path):
    from clu import metric_writers
    self._writer = metric_writers.SummaryWriter(str(logdir))

  def write_scalars(self, step, scalars):
    self._writer.write_scalars(step, scalars)

  def write_texts(self, step, texts):
    self._writer.write_texts(step, texts)

  def write_hparams(self, hparams):
    self._writer.write_hparams(hparams)

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


class MultiWriter(LoggingWriter):
  def __init__(self, writers: list[LoggingWriter]):
    self.writers = writers

  def write_scalars(self, step, scalars):
    for w in self.writers:
      w.write_scalars(step, scalars)

  def write_texts(self, step, texts):
    for w in self.writers:
      w.write_texts(step, texts)

  def write_hparams(self, hparams):
    for w in self.writers:
      w.write_hparams(hparams)

  def flush(self):
    for w in self.writers:
      w.flush()

  def close(self):
    for w in self.writers:
      w.close()


def tensorflow_available() -> bool:
  try:
    return importlib.util.find_spec("tensorflow") is not None
  except (ImportError, ValueError):
    return False


def create(workdir: str | Path, is_primary: bool, resume_step: int = 0) -> LoggingWriter:
  """Console on every host; on the primary also TensorBoard events and metrics.jsonl (from
  which the lines after `resume_step` are dropped)."""
  if not is_primary:
    return LoggingWriter()
  events = CluWriter if tensorflow_available() else TensorBoardXWriter
  # metrics.jsonl first: a step on the console is already in the file.
  return MultiWriter([JsonlWriter(Path(workdir) / "metrics.jsonl", resume_step),
                      events(workdir), LoggingWriter()])


class Progress:
  """Steps per second (evaluation time excluded) and time left, measured between calls: the
  steps left at that rate and the evaluations left (every `eval_every` steps and at the last)
  at the mean time of those done so far."""

  def __init__(self, num_steps: int, start_step: int, eval_every: int = 0):
    self.num_steps, self.last_step, self.eval_every = num_steps, start_step, eval_every
    self.last_time, self.paused = time.perf_counter(), 0.0
    self.eval_seconds, self.evals = 0.0, 0

  def exclude(self, seconds: float) -> None:
    """Time spent in an evaluation (its metrics, BLEU) since the last report."""
    self.paused += seconds
    self.eval_seconds += seconds
    self.evals += 1

  def evals_left(self, step: int) -> int:
    """Evaluations after `step`: each multiple of eval_every up to num_steps, and the last."""
    if not self.eval_every or step >= self.num_steps:
      return 0
    multiples = self.num_steps // self.eval_every - step // self.eval_every
    return multiples + (self.num_steps % self.eval_every != 0)

  def seconds_left(self, step: int, rate: float) -> float:
    mean_eval = self.eval_seconds / self.evals if self.evals else 0.0
    return (self.num_steps - step) / max(rate, 1e-9) + self.evals_left(step) * mean_eval

  def report(self, step: int, goodput: float | None = None) -> dict[str, float]:
    """The progress line; `goodput`: the share of the run's wall time spent in train steps."""
    now = time.perf_counter()
    elapsed = max(now - self.last_time - self.paused, 1e-9)
    rate = (step - self.last_step) / elapsed
    logging.info("Step %d of %d (%.0f%%), %.2f steps/s, about %.0f min left%s", step,
                 self.num_steps, 100 * step / self.num_steps, rate,
                 self.seconds_left(step, rate) / 60,
                 "" if goodput is None else f", goodput {100 * goodput:.0f}%")
    self.last_step, self.last_time, self.paused = step, now, 0.0
    return {"steps_per_sec": rate, "seconds": elapsed}
