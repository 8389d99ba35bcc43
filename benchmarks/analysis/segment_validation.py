"""Which sources to translate sentence by sentence, chosen on validation documents.

The validation pairs of a run, shuffled (seed 0) and joined into documents of 1 to 6 sentences
(sources and targets each joined with a space), are translated whole (sources over max_len
truncated, as before) and sentence by sentence (segment.py). A threshold T takes the sentence-by-
sentence translation for documents of more than T tokens and the whole one for the rest; the
table gives sacreBLEU for each T, overall and by document length.

Usage: PYTHONPATH=. python benchmarks/analysis/segment_validation.py \
    WORKDIR OUTDIR   (beam 4, alpha 1.0, --noema: the README's Tatoeba decode)
"""
import sys
from pathlib import Path

import numpy as np
import sacrebleu

from transformer_jax.decoding.generation import DecodeOptions
from transformer_jax.decoding.translator import split_pairs, translate_lines
from transformer_jax.decoding.translator import Translator

workdir, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
lines, refs = split_pairs(workdir, "validation")
rng = np.random.default_rng(0)
order = rng.permutation(len(lines))
docs, doc_refs, sizes, i = [], [], [], 0
while i < len(order):
  k = int(rng.integers(1, 7))
  group = order[i:i + k]
  docs.append(" ".join(lines[j] for j in group))
  doc_refs.append(" ".join(refs[j] for j in group))
  sizes.append(len(group))
  i += k
(out / "docs.src").write_text("".join(d + "\n" for d in docs))
(out / "docs.ref").write_text("".join(d + "\n" for d in doc_refs))

translator = Translator(workdir, ema=False)
options = DecodeOptions(beam_size=4, alpha=1.0)
hyps = {}
for name, over in (("whole", None), ("sentences", 0)):
  path = out / f"docs.{name}.hyp"
  if not path.exists():
    path.write_text("".join(h + "\n" for h in translate_lines(translator, docs, options, 64,
                                                               segment_over=over)))
  hyps[name] = path.read_text().splitlines()

lengths = np.array([len(ids) + 1 for ids in translator.tokenizers.src.encode(docs)])
buckets = [(1, 24), (25, 48), (49, 64), (65, 10**6)]
print(f"{len(docs)} documents from {len(lines)} validation pairs; tokens per document: "
      f"median {int(np.median(lengths))}, max {lengths.max()}, over 64: {(lengths > 64).sum()}")
in_bucket = lambda lo, hi: (lengths >= lo) & (lengths <= hi)
print("| split documents of more than | all | " +
      " | ".join(f"{lo}-{hi if hi < 10**6 else ''} tokens (n={in_bucket(lo, hi).sum()})"
                 for lo, hi in buckets) + " |")
for over in (None, 64, 48, 32, 16, 0):
  chosen = [hyps["sentences"][d] if over is not None and lengths[d] > over else hyps["whole"][d]
            for d in range(len(docs))]
  cells = []
  for mask in [lengths > 0] + [in_bucket(lo, hi) for lo, hi in buckets]:
    bleu = sacrebleu.corpus_bleu([h for h, m in zip(chosen, mask) if m],
                                 [[r for r, m in zip(doc_refs, mask) if m]])
    cells.append(f"{bleu.score:.2f}")
  print(f"| {'never' if over is None else over} | " + " | ".join(cells) + " |")
