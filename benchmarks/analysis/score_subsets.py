"""BLEU of validation hypotheses overall and on sources of >= 12 and >= 16 tokens (counted by
the workdir's tokenizer; runs B, C and D have the same one).
Usage: [WORKDIR=runs/rB] PYTHONPATH=. python benchmarks/analysis/score_subsets.py HYP..."""
import os
import sys
import numpy as np, sacrebleu, sentencepiece as spm
from transformer_jax.decoding.translator import split_pairs
W = os.environ.get('WORKDIR', 'runs/rB')
lines, refs = split_pairs(W, 'validation')
sp = spm.SentencePieceProcessor(model_file=W + '/tokenizer.model')
n = np.array([len(x) for x in sp.encode(lines)])
for path in sys.argv[1:]:
  hyps = open(path).read().splitlines()
  out = [path.rsplit('/', 1)[-1]]
  for lo in (0, 12, 16):
    m = n >= lo
    b = sacrebleu.corpus_bleu([h for h, k in zip(hyps, m) if k], [[r for r, k in zip(refs, m) if k]])
    out.append(f'>={lo}: {b.score:.2f} (BP {b.bp:.3f}, n={m.sum()})')
  print(' | '.join(out))
