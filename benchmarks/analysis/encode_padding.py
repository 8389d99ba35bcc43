"""Source tokens the decoding slots' encoder computes, padding included, over the real ones, by
the multiple a batch's width is rounded up to: a file's sources, sorted longest first within
each width class, taken a batch of `--slots` at a time (as a lane of `translate` takes them).

  python benchmarks/analysis/encode_padding.py runs/fra_eng TATOEBA.eng --slots 128,32

Prints, per slot count and multiple, the padded tokens over the real ones and how many (class,
width) pairs (encoder programs, before batch sizes) the file meets. With `--pack W`, also the
tokens computed if each batch's sources were packed into rows of W tokens (first fit, longest
first; W at least the widest class), several short sources a row, over the real ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transformer_jax.commands.translate import read_lines  # noqa: E402
from transformer_jax.data import packing  # noqa: E402
from transformer_jax.decoding.translator import SLOT_WIDTHS  # noqa: E402
from transformer_jax.workdir import Workdir  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("input")
  parser.add_argument("--slots", default="128,32", help="Slot counts, comma-separated.")
  parser.add_argument("--multiples", default="8,4,2,1")
  parser.add_argument("--pack", type=int, default=0, help="Also rows of this many tokens, packed.")
  args = parser.parse_args()
  workdir = Workdir(args.workdir)
  max_len = workdir.load_config().data.max_len
  lengths = [min(len(ids) + 1, max_len)
             for ids in workdir.tokenizers().src.encode(read_lines(args.input))]
  full = -(-max_len // 8) * 8
  widths = [w for w in SLOT_WIDTHS["cpu"] if w < full] + [full]
  if args.pack and args.pack < full:
    sys.exit(f"--pack {args.pack} is narrower than the widest class ({full} tokens)")
  classes: dict[int, list[int]] = {}
  for n in sorted(lengths, reverse=True):
    classes.setdefault(next(w for w in widths if n <= w), []).append(n)
  real = sum(lengths)
  print(f"{len(lengths)} sources, {real} tokens with <eos>; width classes {widths}")
  for slots in map(int, args.slots.split(",")):
    for multiple in map(int, args.multiples.split(",")):
      padded, programs = 0, set()
      for cls, members in classes.items():
        for start in range(0, len(members), slots):
          batch = members[start:start + slots]
          width = min(cls, -(-max(batch) // multiple) * multiple)
          padded += width * len(batch)
          programs.add((cls, width))
      print(f"slots {slots:4d}, multiple {multiple}: {padded / real:.3f}x the real tokens, "
            f"{len(programs)} (class, width) pairs")
    if args.pack:
      rows = sum(_packed_rows(members[start:start + slots], args.pack)
                 for members in classes.values() for start in range(0, len(members), slots))
      print(f"slots {slots:4d}, packed in rows of {args.pack}: {rows * args.pack / real:.3f}x "
            "the real tokens")


def _packed_rows(lengths: list[int], width: int) -> int:
  """The rows of `width` tokens that `lengths` take when each goes, in turn, to the first row
  with room for it (training's packer, with a row to spare for each)."""
  n = len(lengths)
  (plan,) = packing.first_fit(np.asarray(lengths), np.ones(n, np.int64), n, width)
  return len(set(plan.row.tolist()))

if __name__ == "__main__":
  main()
