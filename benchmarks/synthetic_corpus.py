"""Writes a large synthetic parallel corpus with WMT-like sentence lengths, for testing scale
without the internet:

  python benchmarks/synthetic_corpus.py --out data/synth5m --pairs 5000000

Output: OUT/train.tsv and OUT/validation.tsv (`source<TAB>target` lines), which the
`parallel_tsv` dataset reads (`--config.data.dataset=parallel_tsv --config.data.data_dir=OUT`).

Sentences are words of a Zipf-distributed 60,000-word vocabulary of pronounceable made-up
words; source lengths in words are log-normal (median 21, mean about 25, 1 to 150: close to
WMT14 en-de newstest sentences), and each target is a word-by-word "translation" through a
fixed random dictionary, with its length within about 15% of the source's and some local
reordering, so a tokenizer and a model see realistic statistics. Seeded: the same arguments
give the same files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

SYLLABLES = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"] + ["an", "en", "in", "on", "er"]


def vocabulary(rng: np.random.Generator, size: int) -> np.ndarray:
  """`size` distinct made-up words of 1 to 4 syllables."""
  words: set[str] = set()
  while len(words) < size:
    n = rng.integers(1, 5, size)
    parts = rng.integers(0, len(SYLLABLES), (size, 4))
    words.update("".join(SYLLABLES[p] for p in row[:k]) for row, k in zip(parts, n))
  return rng.permutation(np.array(sorted(words)[:size]))  # Frequency rank apart from spelling.


def sentences(rng: np.random.Generator, n: int, src_vocab: np.ndarray, tgt_vocab: np.ndarray,
              dictionary: np.ndarray, zipf_p: np.ndarray) -> list[str]:
  """`n` tab-separated pairs, as lines."""
  src_len = np.clip(np.rint(rng.lognormal(np.log(21), 0.55, n)), 1, 150).astype(np.int64)
  tgt_len = np.clip(np.rint(src_len * rng.normal(1.05, 0.15, n)), 1, 160).astype(np.int64)
  words = rng.choice(len(src_vocab), int(src_len.sum()), p=zipf_p)
  ends = np.cumsum(src_len)
  lines = []
  for i in range(n):
    src = words[ends[i] - src_len[i]:ends[i]]
    tgt = dictionary[src]
    if tgt_len[i] > len(tgt):  # Longer target: repeat a few words.
      tgt = np.concatenate([tgt, tgt[:tgt_len[i] - len(tgt)]])
    tgt = tgt[:tgt_len[i]]
    if len(tgt) > 3:  # Local reordering: swap one neighbouring pair.
      j = int(rng.integers(0, len(tgt) - 1))
      tgt[[j, j + 1]] = tgt[[j + 1, j]]
    lines.append(" ".join(src_vocab[src]) + "\t" + " ".join(tgt_vocab[tgt]) + "\n")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="Directory to write train.tsv and "
                      "validation.tsv into.")
  parser.add_argument("--pairs", type=int, default=1_000_000, help="Training pairs.")
  parser.add_argument("--validation_pairs", type=int, default=3000)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if args.pairs < 1 or args.validation_pairs < 1:
    parser.error("--pairs and --validation_pairs must be positive")
  rng = np.random.default_rng(args.seed)
  size = 60_000
  src_vocab, tgt_vocab = vocabulary(rng, size), vocabulary(rng, size)
  dictionary = rng.permutation(size)
  zipf_p = 1.0 / np.arange(1, size + 1) ** 1.05
  zipf_p /= zipf_p.sum()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  for name, n in (("validation", args.validation_pairs), ("train", args.pairs)):
    tmp = out / f"{name}.tsv.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      for done in range(0, n, 100_000):
        f.writelines(sentences(rng, min(100_000, n - done), src_vocab, tgt_vocab, dictionary,
                               zipf_p))
        if done and done % 1_000_000 == 0:
          print(f"{name}: {done:,} of {n:,} pairs ({time.perf_counter() - start:.0f} s)")
    tmp.replace(out / f"{name}.tsv")
  print(f"wrote {args.pairs:,} + {args.validation_pairs:,} pairs to {out} in "
        f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
