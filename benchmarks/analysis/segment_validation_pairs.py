"""The same thresholds on the validation pairs themselves (3,323, mostly one sentence each):
lines that pysbd splits are translated sentence by sentence; the rest keep the whole-line
hypotheses of HYP (the run's `translate --split validation --noema --beam_size 4 --alpha 1.0`).

Usage: PYTHONPATH=. python benchmarks/analysis/segment_validation_pairs.py \
    WORKDIR HYP OUTDIR
"""
import sys
from pathlib import Path

import numpy as np
import sacrebleu

from transformer_jax.decoding import sentences
from transformer_jax.decoding.generation import DecodeOptions
from transformer_jax.decoding.translator import split_pairs, translate_lines
from transformer_jax.decoding.translator import Translator

workdir, whole_path, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
lines, refs = split_pairs(workdir, "validation")
whole = Path(whole_path).read_text().splitlines()
translator = Translator(workdir, ema=False)
multi = [i for i, line in enumerate(lines) if len(sentences.sentences(line, "en")) > 1]
path = out / "pairs_multi.sentences.hyp"
if not path.exists():
  hyps = translate_lines(translator, [lines[i] for i in multi],
                         DecodeOptions(beam_size=4, alpha=1.0), 64, segment_over=0)
  path.write_text("".join(h + "\n" for h in hyps))
split = dict(zip(multi, path.read_text().splitlines()))
lengths = np.array([len(ids) + 1 for ids in translator.tokenizers.src.encode(lines)])
print(f"{len(lines)} validation pairs, {len(multi)} of them more than one sentence (pysbd)")
for over in (None, 32, 16, 0):
  chosen = [split[i] if over is not None and i in split and lengths[i] > over else whole[i]
            for i in range(len(lines))]
  bleu = sacrebleu.corpus_bleu(chosen, [refs])
  n = sum(1 for i in split if over is not None and lengths[i] > over)
  print(f"split lines of more than {'never' if over is None else over} tokens: BLEU "
        f"{bleu.score:.2f} (BP {bleu.bp:.3f}; {n} lines split)")
