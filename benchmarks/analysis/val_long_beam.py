"""A larger beam for long sources, from existing validation hypotheses of run B (runs/rB,
step 2,000, --noema, alpha 1.0, whole sources): beam 4 for every source, with beam 6 or 8 for
sources of more than T tokens (with <eos>); then a paired bootstrap (1,000 resamples) of beam 8
and 6 against 4 on the sources over 16 tokens.

Usage: PYTHONPATH=. python benchmarks/analysis/val_long_beam.py \
    BEAM4_HYP BEAM6_HYP BEAM8_HYP
(run with runs/evalB/val_raw_b4_a1.hyp runs/evalD/val_b6_a1.hyp
runs/evalD/val_b8_a1.hyp: the hypotheses of recipe/val_raw_b4_a1.log, val_raw_b6_a1.log,
val_raw_b8_a1.log)
"""
import sys

import numpy as np
import sacrebleu
import sentencepiece as spm
from sacrebleu.metrics import BLEU

from transformer_jax.decoding.translator import split_pairs

W = "runs/rB"
lines, refs = split_pairs(W, "validation")
sp = spm.SentencePieceProcessor(model_file=W + "/tokenizer.model")
n = np.array([len(x) + 1 for x in sp.encode(lines)])
h4, h6, h8 = (open(p).read().splitlines() for p in sys.argv[1:4])
for name, hb in (("beam 6", h6), ("beam 8", h8)):
  for t in (8, 10, 12, 14, 16, 18, 20, 24):
    hyp = [b if k > t else a for a, b, k in zip(h4, hb, n)]
    print(f"{name} over {t} tokens ({(n > t).sum()} sources): "
          f"{sacrebleu.corpus_bleu(hyp, [refs]).score:.2f}")

bleu = BLEU()
idx = np.where(n > 16)[0]
R = [refs[i] for i in idx]


def stats(hyps):
  return np.array([[*s.counts, *s.totals, s.sys_len, s.ref_len]
                   for s in (bleu.corpus_score([h], [[r]]) for h, r in zip(hyps, R))], float)


def score(s):
  p = s[:4] / np.maximum(s[4:8], 1)
  if (p == 0).any():
    return 0.0
  return 100 * min(1.0, np.exp(1 - s[9] / s[8])) * np.exp(np.log(p).mean())


rng = np.random.default_rng(0)
A = stats([h4[i] for i in idx])
for name, hb in (("beam 6", h6), ("beam 8", h8)):
  B = stats([hb[i] for i in idx])
  diffs = []
  for _ in range(1000):
    s = rng.integers(0, len(idx), len(idx))
    diffs.append(score(B[s].sum(0)) - score(A[s].sum(0)))
  diffs = np.array(diffs)
  print(f"sources over 16 tokens ({len(idx)}): beam 4 {score(A.sum(0)):.2f}, {name} "
        f"{score(B.sum(0)):.2f}; ahead in {(diffs > 0).mean():.1%} of resamples, 95% interval "
        f"{np.percentile(diffs, 2.5):+.2f} to {np.percentile(diffs, 97.5):+.2f}")
