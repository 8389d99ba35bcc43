"""Decoder rows the slots compute for a file against the rows its searches need: every row of
a run's active size at every step it ran (idle slots included), against each search's own
steps (greedy: its output with <eos>; beam K: K rows a step until its K-th hypothesis ends,
less the K - 1 rows of the first step, whose beams are all <bos> and which CTranslate2
computes as one). Also times one pass with the programs kept in the workdir's cache and a
second, warm pass, with the decoder steps the warm pass ran (on an accelerator, the pass's
seconds a step say whether the steps are what it waits on). Usage:
  python benchmarks/analysis/slot_rows.py WORKDIR INPUT [--beam_size K] [--alpha A] [--slots N]
      [--no_scores] [--programs DIR] [--json FILE]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from transformer_jax.decoding import slots  # noqa: E402
from transformer_jax.decoding.generation import DecodeOptions, encode_sources, strip  # noqa: E402
from transformer_jax.programs import ProgramStore  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("input")
  parser.add_argument("--beam_size", type=int, default=1)
  parser.add_argument("--alpha", type=float, default=1.0)
  parser.add_argument("--slots", type=int, default=0,
                      help="slot count (default: translate's for this platform and beam size)")
  parser.add_argument("--no_scores", action="store_true",
                      help="greedy searches without their scores, as translate decodes a file")
  parser.add_argument("--programs", help="the kept programs (default WORKDIR/jax_cache/programs; "
                      "translate's are COMPILATION_CACHE_DIR/programs)")
  parser.add_argument("--json", help="also write the figures to this file")
  args = parser.parse_args()
  programs = Path(args.programs or Path(args.workdir) / "jax_cache" / "programs")
  translator = Translator(args.workdir, programs=ProgramStore(programs))
  lines = [line for line in Path(args.input).read_text(encoding="utf-8").splitlines()
           if line.strip()]
  src = encode_sources(translator.tokenizers.src, lines, translator.max_src_len)
  rows = [row[row != 0] for row in src]
  options = DecodeOptions(beam_size=args.beam_size, alpha=args.alpha, scores=not args.no_scores)
  count = args.slots or slots.default_slots(jax.default_backend(), args.beam_size)
  seconds = []
  for _ in range(2):
    for decoder in translator._slot_decoders.values():
      decoder.rows_stepped = decoder.steps_run = 0
    start = time.perf_counter()
    results = translator.decode_slots(rows, options, count)
    seconds.append(time.perf_counter() - start)
  stepped = sum(d.rows_stepped for d in translator._slot_decoders.values())
  steps = sum(d.steps_run for d in translator._slot_decoders.values())
  k, needed = args.beam_size, 0
  for (tokens, _), ids in zip(results, rows):
    limit = -(-len(ids) // 8) * 8 + options.max_len_margin  # translate's output limit.
    needed += k * min(max(len(strip(t)) + 1 for t in tokens), limit) - (k - 1)
  print(f"{Path(args.input).name}, {len(rows)} sources, beam {k}"
        f"{', no scores' if args.no_scores else ''}, {count} slots, "
        f"{translator.lanes} lanes: rows stepped {stepped:,}, needed {needed:,} "
        f"({stepped / needed:.3f}x); first pass {seconds[0]:.1f} s, warm pass {seconds[1]:.1f} s "
        f"({len(rows) / seconds[1]:.1f} sources/s), {steps:,} steps in the warm pass "
        f"({1000 * seconds[1] / steps:.2f} ms of the pass a step)")
  if args.json:
    figures = {"input": Path(args.input).name, "sources": len(rows), "beam_size": k,
               "slots": count, "scores": options.scores, "lanes": translator.lanes,
               "device": str(jax.devices()[0]),
               "rows_stepped": stepped, "rows_needed": needed, "first_pass_s": seconds[0],
               "warm_pass_s": seconds[1], "warm_sources_per_s": len(rows) / seconds[1],
               "warm_steps": steps}
    Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
  main()
