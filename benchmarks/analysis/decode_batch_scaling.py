"""How much batching can gain at all: the decoder's sentences/s at 1, 2, 4, ... sentences a
batch, in this process (no HTTP), for one source width, greedy and with a beam; with
`--threads N`, N threads decoding batches at once (as the server's decoders do).

  python benchmarks/analysis/decode_batch_scaling.py runs/fra_eng --width 16 --beam_sizes 1,4
  python benchmarks/analysis/decode_batch_scaling.py runs/fra_eng --width 16 --threads 2

The sources are the workdir's validation sentences of width-8 < tokens <= width. Each row of
the table decodes at least --sentences sentences in batches of that size, after one warm-up
batch (its compilation); "vs 1 row" compares with one thread decoding 1 sentence a batch.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import sources_of_width  # noqa: E402
from transformer_jax.decoding.generation import DecodeOptions  # noqa: E402
from transformer_jax.decoding.translator import Translator, split_pairs  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--beam_sizes", default="1,4")
  parser.add_argument("--rows", default="1,2,4,8,16,32")
  parser.add_argument("--sentences", type=int, default=128)
  parser.add_argument("--alpha", type=float, default=1.0)
  parser.add_argument("--threads", type=int, default=1, help="Threads decoding at once.")
  args = parser.parse_args()
  translator = Translator(args.workdir)
  lines, src = sources_of_width(translator, split_pairs(args.workdir, "validation")[0],
                                args.width)
  print(f"{len(lines)} validation sources of {args.width - 7} to {args.width} tokens")
  print(f"{'beam':>5}{'rows':>6}{'threads':>8}{'sentences/s':>13}{'ms a batch':>12}"
        f"{'vs 1 row':>10}")
  for beam in map(int, args.beam_sizes.split(",")):
    options = DecodeOptions(beam_size=beam, alpha=args.alpha)
    single = None
    for rows in map(int, args.rows.split(",")):
      if beam * rows * args.width > 4096 or rows > len(lines):
        continue
      translator.decode(src[:rows], options)  # Compiles.
      for threads in sorted({1, args.threads}):
        seconds, done = _decode_for(translator, src, rows, options, args.sentences, threads)
        rate = done / seconds
        single = single or rate
        print(f"{beam:>5}{rows:>6}{threads:>8}{rate:>13.1f}"
              f"{1000 * seconds * rows * threads / done:>12.1f}{rate / single:>9.2f}x",
              flush=True)


def _decode_for(translator, src, rows: int, options, sentences: int,
                threads: int) -> tuple[float, int]:
  """(seconds, sentences decoded): `threads` threads each decoding batches of `rows` sources
  until they have `sentences` between them."""
  count = -(-sentences // (rows * threads))  # Batches per thread.

  def work(first: int) -> None:
    for b in range(count):
      at = ((b * threads + first) * rows) % (len(src) - rows + 1)
      translator.decode(src[at:at + rows], options)

  pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
  start = time.perf_counter()
  for thread in pool:
    thread.start()
  for thread in pool:
    thread.join()
  return time.perf_counter() - start, count * rows * threads


if __name__ == "__main__":
  main()
