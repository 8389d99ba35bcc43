"""What scoring costs greedy decoding: the tokens-only decoder (`generation.generate`, jitted
here) against the scored one translate and the server use (`Translator.decode_ids`),
round-robin in one process.

  python benchmarks/analysis/greedy_score_cost.py runs/fra_eng --width 16 --rounds 5

The sources are the workdir's validation sentences of width-8 < tokens <= width, 512 of them
in batches of 64; each round decodes them all with each decoder; the medians are printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import sources_of_width  # noqa: E402
from transformer_jax.decoding.generation import generate  # noqa: E402
from transformer_jax.decoding.translator import Translator, split_pairs  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  translator = Translator(args.workdir)
  lines, src = sources_of_width(translator, split_pairs(args.workdir, "validation")[0],
                                args.width, 512)
  max_len, params = args.width + 10, translator.all_params
  tokens_only = jax.jit(lambda params, src: generate(translator.models, params, src, max_len))
  decoders = {
      "tokens only (generate)": lambda b: tokens_only(params, b),
      "tokens and scores (decode_ids)": lambda b: translator.decode_ids(params, b, max_len, 1,
                                                                        np.float32(1.0))[0]}
  for decode in decoders.values():
    np.asarray(decode(src[:64]))  # Compiles.
  times = {name: [] for name in decoders}
  for _ in range(args.rounds):
    for name, decode in decoders.items():
      start = time.perf_counter()
      for i in range(0, len(src) - 63, 64):
        np.asarray(decode(src[i:i + 64]))
      times[name].append(time.perf_counter() - start)
  base = np.median(times["tokens only (generate)"])
  print(f"{len(src) // 64 * 64} validation sources of {args.width - 7} to {args.width} tokens, "
        f"64 a batch, greedy, median of {args.rounds} rounds")
  for name, seconds in times.items():
    print(f"{name:<32}{1000 * np.median(seconds):>8.0f} ms  {np.median(seconds) / base:.3f}x")


if __name__ == "__main__":
  main()
