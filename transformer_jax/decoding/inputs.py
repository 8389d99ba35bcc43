"""What the decoding commands read and where they write: the lines of an input file (or standard
input), a split of the dataset a run was trained on, and an output path checked before any
work. Shared by translate, generate, fill, classify, serve's load test and the benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

from transformer_jax import errors, fs
from transformer_jax.decoding.options import InferenceError
from transformer_jax.runs.workdir import Workdir, check_file_outside_runs


def read_lines(path: str) -> list[str]:
  """The lines of a UTF-8 text file, ended by "\n" (or "\r\n"), as `wc -l` counts them: a
  lone "\r" inside a line stays in it; "-" reads standard input. An error names the first
  line that is not UTF-8."""
  p = Path(path)
  if path != "-" and not p.is_file():
    raise InferenceError(f"{path} does not exist or is not a file")
  raw_lines = (sys.stdin.buffer.read() if path == "-" else p.read_bytes()).split(b"\n")
  if raw_lines[-1] == b"":  # The file ends with "\n" (or is empty).
    raw_lines.pop()
  lines = []
  for number, raw in enumerate((r.removesuffix(b"\r") for r in raw_lines), 1):
    try:
      lines.append(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise InferenceError(f"{path} line {number} is not UTF-8 text (byte {e.start + 1}: "
                           f"{raw[e.start:e.start + 1]!r})") from None
  return lines


def check_output_path(path: str) -> None:
  """Raises before any work where `path` cannot be written as a file, or would replace a
  run's, a dataset's or any file that is not text."""
  p = Path(path)
  if p.is_dir():
    raise InferenceError(f"--output {path} is a directory")
  if not p.parent.is_dir():
    raise InferenceError(f"--output {path}: directory {p.parent} does not exist")
  fs.check_writable(p, "--output")
  check_file_outside_runs(p, "--output")
  fs.check_replaceable(p, "--output", "text")


def split_pairs(workdir: str, split: str) -> tuple[list[str], list[str]]:
  """(sources, references) of a split of the dataset a workdir was trained on."""
  from transformer_jax.data import sources
  from transformer_jax.data.builders import DatasetError
  config = Workdir(workdir).load_config().data
  if config.data_dir and not Path(config.data_dir).is_dir():  # Moved, or another directory.
    raise InferenceError(
        f"--split {split} reads the run's corpus, data.data_dir={config.data_dir!r} in its "
        f"config.json, which is not a directory from {Path.cwd()}: run from where that path "
        "names the corpus, or translate the split's sources with --input FILE")
  try:
    builder = sources.prepare_config(config)
    pairs = sources.pairs(builder, config.dataset, split)
  except (DatasetError, FileNotFoundError, ValueError, KeyError) as e:
    raise InferenceError(f"--split {split} of {config.dataset} (data_dir="
                         f"{config.data_dir!r}) cannot be read: {errors.first_line(e)}"
                         ) from None
  if not pairs:
    raise InferenceError(f"--split {split} of {config.dataset} is empty")
  return [s for s, _ in pairs], [t for _, t in pairs]
