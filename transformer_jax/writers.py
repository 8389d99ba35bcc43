"""Metric writers: clu's console + TensorBoard writers, plus one JSON line per logged step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from clu import metric_writers


class JsonlWriter(metric_writers.MetricWriter):
  """Appends every scalar write to a file as one JSON object a line, keyed by `step`."""

  def __init__(self, path: str | Path):
    self._file = open(path, "a", encoding="utf-8")

  def write_scalars(self, step, scalars):
    record = {"step": int(step), **{k: float(np.asarray(v)) for k, v in scalars.items()}}
    self._file.write(json.dumps(record) + "\n")

  def write_texts(self, step, texts):
    self._file.write(json.dumps({"step": int(step), **texts}) + "\n")

  def write_summaries(self, step, values, metadata=None): pass
  def write_images(self, step, images): pass
  def write_videos(self, step, videos): pass
  def write_audios(self, step, audios, *, sample_rate): pass
  def write_histograms(self, step, arrays, num_buckets=None): pass
  def write_hparams(self, hparams): pass

  def flush(self):
    self._file.flush()

  def close(self):
    self._file.close()


def create(workdir: str | Path, is_primary: bool) -> metric_writers.MetricWriter:
  """TensorBoard events and metrics.jsonl in `workdir` on the primary host; console on all."""
  if not is_primary:
    return metric_writers.LoggingWriter()
  return metric_writers.MultiWriter([
      metric_writers.create_default_writer(str(workdir), asynchronous=False),
      JsonlWriter(Path(workdir) / "metrics.jsonl")])
