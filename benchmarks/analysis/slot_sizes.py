"""Sentences/s of translate's slot decoder at several slot counts and refill points, on the
sources of a file of at most --width tokens (one width class), after a warm-up pass each.

  python benchmarks/analysis/slot_sizes.py runs/fra_eng TATOEBA.eng --beam_size 4 \
      --limit 1500 --width 16 32:4 16:2 64:8

Each SPEC is SLOTS:REFILL_AT (searches, and the free slots that end a run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformer_jax.decoding.generation import DecodeOptions, encode_sources  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("input")
  parser.add_argument("specs", nargs="+")
  parser.add_argument("--beam_size", type=int, default=1)
  parser.add_argument("--alpha", type=float, default=1.0)
  parser.add_argument("--limit", type=int, default=1500)
  parser.add_argument("--width", type=int, default=16)
  args = parser.parse_args()
  translator = Translator(args.workdir)
  lines = Path(args.input).read_text(encoding="utf-8").splitlines()[:args.limit]
  src = encode_sources(translator.tokenizers.src, lines, translator.max_src_len)
  rows = [r[r != 0] for r in src if (r != 0).sum() <= args.width]
  limits = [-(-len(r) // 8) * 8 + 10 for r in rows]
  options = DecodeOptions(beam_size=args.beam_size, alpha=args.alpha)
  for spec in args.specs:
    count, refill_at = map(int, spec.split(":"))
    decoder = translator.slot_decoder(options, count, args.width, use="file")  # translate's
    decoder.decode_all(rows, limits, args.alpha, refill_at=refill_at)
    start = time.perf_counter()
    decoder.decode_all(rows, limits, args.alpha, refill_at=refill_at)
    seconds = time.perf_counter() - start
    print(f"beam {args.beam_size}, {count} slots, refill at {refill_at}: {len(rows)} sources, "
          f"{len(rows) / seconds:.1f} sentences/s", flush=True)


if __name__ == "__main__":
  main()
