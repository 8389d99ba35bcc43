"""What the slots' encoder program costs by the source tokens it computes at once: batches of
ROWSxWIDTH random source ids, each encoded whole and in chunks of rows of at most `--tokens`
tokens (slots.encode_in_chunks), timed one call after another in one thread. Usage:
  python benchmarks/analysis/encode_chunks.py runs/fra_eng --batches 128x16,128x32,128x64 \
      --tokens 0,512,1024,2048 --json encode_chunks.json
Prints, per batch and budget, the rows of a chunk, the median call (of `--repeats`, after one
that is not counted) and its microseconds per source token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.machine import cpu_model  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--batches", default="128x16,128x32,128x64,32x64",
                      help="ROWSxWIDTH, comma-separated.")
  parser.add_argument("--tokens", default="0,512,1024,2048",
                      help="Token budgets of a chunk, comma-separated (0: the batch whole).")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  import jax
  import numpy as np

  from transformer_jax.decoding import slots
  from transformer_jax.decoding.generation import DecodeOptions
  from transformer_jax.decoding.translator import Translator

  translator = Translator(args.workdir)
  rng = np.random.default_rng(0)
  rows_out = []
  for batch in args.batches.split(","):
    rows, width = map(int, batch.split("x"))
    src = rng.integers(5, translator.tokenizers.src.vocab_size, (rows, width), dtype=np.int32)
    for tokens in map(int, args.tokens.split(",")):
      translator.encode_tokens = tokens
      decoder = translator.slot_decoder(DecodeOptions(), rows, translator.slot_widths[-1])
      times = []
      for _ in range(args.repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(decoder._encode(decoder.params, src))
        times.append(time.perf_counter() - start)
      median = statistics.median(times[1:])
      row = {"rows": rows, "width": width, "tokens": tokens,
             "chunk_rows": slots.chunk_rows(rows, width, tokens), "median_ms": median * 1e3,
             "us_per_token": median * 1e6 / (rows * width)}
      rows_out.append(row)
      print(f"{rows:4d} x {width:3d}, budget {tokens:5d} ({row['chunk_rows']:4d} rows a chunk):"
            f" {row['median_ms']:7.1f} ms, {row['us_per_token']:6.1f} us a token", flush=True)
  header = (f"{cpu_model()}, {os.cpu_count()} cores; jax {jax.__version__}; "
            f"{Path(args.workdir).name}; {time.strftime('%Y-%m-%d')}")
  print(header)
  if args.json:
    Path(args.json).write_text(json.dumps({"header": header, "command": sys.argv,
                                           "rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
  main()
