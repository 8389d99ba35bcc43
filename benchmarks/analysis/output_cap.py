"""Validation or Tatoeba BLEU of run B (step 2000, beam 4) with the output cap
RATIO x source width + 10 (issue 12 experiment, 2026-11-23; the record of the README's figures,
not part of the library). Usage, from the repository root:
  PYTHONPATH=. python benchmarks/analysis/output_cap.py RATIO BEAM ALPHA SPLIT
with SPLIT validation or tatoeba."""
import sys, time
import numpy as np, sacrebleu, sentencepiece as spm
from transformer_jax.decoding import translator as tr_mod
from transformer_jax.decoding.generation import DecodeOptions, encode_sources
from transformer_jax.decoding.translator import translate_lines, split_pairs
from transformer_jax.decoding.translator import Translator

ratio, beam, alpha, split = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
W = 'runs/rB'
t = Translator(W, ema=False)
def translate(self, sentences, options=DecodeOptions(), numbers=None):
  src = encode_sources(self.tokenizers.src, sentences, self.max_src_len, numbers=numbers)
  max_len = int(ratio * src.shape[1]) + options.max_len_margin
  tokens = self.decode(src, DecodeOptions(beam_size=options.beam_size, alpha=options.alpha,
                                          max_len=max_len))[0][:, 0]
  return [self.tokenizers.tgt.decode(tr_mod.strip(row)) for row in tokens]
Translator.translate = translate
if split == 'validation':
  lines, refs = split_pairs(W, 'validation')
else:
  base = '../shared/data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.'
  lines, refs = open(base + 'eng').read().splitlines(), open(base + 'fra').read().splitlines()
t0 = time.time()
hyps = translate_lines(t, lines, DecodeOptions(beam_size=beam, alpha=alpha), 64, progress=False)
sp = spm.SentencePieceProcessor(model_file=W + '/tokenizer.model')
n = np.array([len(x) for x in sp.encode(lines)])
out = [f'ratio={ratio} beam={beam} alpha={alpha} {split} {time.time()-t0:.0f}s']
for lo in (0, 12, 16):
  m = n >= lo
  b = sacrebleu.corpus_bleu([h for h, k in zip(hyps, m) if k], [[r for r, k in zip(refs, m) if k]])
  out.append(f'>={lo}: {b.score:.2f} (BP {b.bp:.3f}, n={m.sum()})')
print(' | '.join(out), flush=True)
open(f'{split}_r{ratio}_b{beam}_a{alpha}.hyp', 'w').write('\n'.join(hyps) + '\n')
