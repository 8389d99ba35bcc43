"""Decoder rows the slots compute for a file against the rows its searches need: every row of
a run's active size at every step it ran (idle slots included), against each search's own
steps (greedy: its output with <eos>; beam K: K rows a step until its K-th hypothesis ends,
less the K - 1 rows of the first step, whose beams are all <bos> and which CTranslate2
computes as one). Also times one pass with the programs kept in the workdir's cache and a
second, warm pass. Usage:
  python benchmarks/analysis/slot_rows.py WORKDIR INPUT [--beam_size K] [--alpha A]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformer_jax import slots  # noqa: E402
from transformer_jax.generation import DecodeOptions, encode_sources, strip  # noqa: E402
from transformer_jax.programs import ProgramStore  # noqa: E402
from transformer_jax.translator import Translator  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("input")
  parser.add_argument("--beam_size", type=int, default=1)
  parser.add_argument("--alpha", type=float, default=1.0)
  args = parser.parse_args()
  translator = Translator(args.workdir,
                          programs=ProgramStore(Path(args.workdir) / "jax_cache" / "programs"))
  lines = [line for line in Path(args.input).read_text(encoding="utf-8").splitlines()
           if line.strip()]
  src = encode_sources(translator.tokenizers.src, lines, translator.max_src_len)
  rows = [row[row != 0] for row in src]
  options = DecodeOptions(beam_size=args.beam_size, alpha=args.alpha)
  count = slots.default_slots("cpu", args.beam_size)
  seconds = []
  for _ in range(2):
    for decoder in translator._slot_decoders.values():
      decoder.rows_stepped = 0
    start = time.perf_counter()
    results = translator.decode_slots(rows, options, count)
    seconds.append(time.perf_counter() - start)
  stepped = sum(d.rows_stepped for d in translator._slot_decoders.values())
  k, needed = args.beam_size, 0
  for (tokens, _), ids in zip(results, rows):
    limit = -(-len(ids) // 8) * 8 + options.max_len_margin  # translate's output limit.
    needed += k * min(max(len(strip(t)) + 1 for t in tokens), limit) - (k - 1)
  print(f"{Path(args.input).name}, {len(rows)} sources, beam {k}, {count} slots, "
        f"{translator.lanes} lanes: rows stepped {stepped:,}, needed {needed:,} "
        f"({stepped / needed:.3f}x); first pass {seconds[0]:.1f} s, warm pass {seconds[1]:.1f} s")


if __name__ == "__main__":
  main()
