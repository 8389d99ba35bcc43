"""Tatoeba BLEU by source length (tokens with <eos>, run B's tokenizer) and by one or more
sentences (pysbd), for each hypothesis file given: whole sources against --segment_over 16.

Usage: PYTHONPATH=. python benchmarks/analysis/tatoeba_by_length.py \
    TOKENIZER_MODEL HYP...
"""
import sys

import numpy as np
import sacrebleu
import sentencepiece as spm

from transformer_jax.decoding import sentences

D = "../shared/data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng."
src = open(D + "eng").read().splitlines()
ref = open(D + "fra").read().splitlines()
n = np.array([len(x) + 1 for x in spm.SentencePieceProcessor(model_file=sys.argv[1]).encode(src)])
multi = np.array([len(sentences.sentences(s, "en")) > 1 for s in src])
hyps = [open(p).read().splitlines() for p in sys.argv[2:]]
print("| sources | pairs | " + " | ".join(p.rsplit("/", 1)[-1] for p in sys.argv[2:]) + " |")
for name, m in [("all", n > 0), ("<= 16 tokens", n <= 16), ("17-32", (n > 16) & (n <= 32)),
                ("33-64", (n > 32) & (n <= 64)), ("over 64", n > 64),
                ("over 16, more than one sentence", multi & (n > 16)),
                ("over 16, one sentence", ~multi & (n > 16))]:
  cells = []
  for h in hyps:
    b = sacrebleu.corpus_bleu([x for x, k in zip(h, m) if k], [[r for r, k in zip(ref, m) if k]])
    cells.append(f"{b.score:.2f} (BP {b.bp:.2f})")
  print(f"| {name} | {m.sum()} | " + " | ".join(cells) + " |")
