"""What the decoding commands read and where they write: the lines of an input file (or standard
input), and an output path checked before any work. Shared by translate, generate, fill,
classify and the benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

from transformer_jax import fs
from transformer_jax.decoding.options import InferenceError


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
  """Raises before any work where `path` cannot be written as a file."""
  p = Path(path)
  if p.is_dir():
    raise InferenceError(f"--output {path} is a directory")
  if not p.parent.is_dir():
    raise InferenceError(f"--output {path}: directory {p.parent} does not exist")
  fs.check_writable(p, "--output")
