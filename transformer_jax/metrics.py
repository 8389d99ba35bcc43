"""Translation quality: sacreBLEU for reporting, and d2l's sentence BLEU for its table."""

from __future__ import annotations

import collections
import math

import sacrebleu


def corpus_bleu(hypotheses: list[str], references: list[str]) -> tuple[float, str]:
  """Corpus sacreBLEU of detokenized output (default 13a tokenizer, cased) and its signature."""
  bleu = sacrebleu.metrics.BLEU()
  score = bleu.corpus_score(hypotheses, [references]).score
  return score, str(bleu.get_signature())


def d2l_bleu(prediction: str, reference: str, k: int = 2) -> float:
  """The d2l chapter's BLEU: brevity penalty times n-gram precisions weighted by 1/2^n."""
  pred, ref = prediction.split(), reference.split()
  if not pred:
    return 0.0
  score = math.exp(min(0.0, 1 - len(ref) / len(pred)))
  for n in range(1, min(k, len(pred)) + 1):
    ref_counts = collections.Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
    matches = 0
    for i in range(len(pred) - n + 1):
      gram = tuple(pred[i:i + n])
      if ref_counts[gram] > 0:
        matches += 1
        ref_counts[gram] -= 1
    score *= math.pow(matches / (len(pred) - n + 1), math.pow(0.5, n))
  return score
