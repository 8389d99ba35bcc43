"""How much of a greedy translation pass is work on rows that already ended: every batch runs
its decoder until its longest output ends (fixed shapes), while only each sentence's own
output needs computing (what CTranslate2 does, dropping finished rows). Usage:
  python benchmarks/analysis/decode_row_steps.py WORKDIR INPUT [BATCH_SIZE BATCH_TOKENS]
Prints row-steps computed (rows x steps of each batch, padding rows included) against row-steps
needed (each sentence's output tokens with <eos>)."""

import sys

import numpy as np

from transformer_jax.decoding.generation import DecodeOptions, encode_sources, strip
from transformer_jax.decoding.translator import Translator, translate_lines

workdir, path = sys.argv[1], sys.argv[2]
batch_size = int(sys.argv[3]) if len(sys.argv) > 3 else 64
batch_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
translator = Translator(workdir)
lines = open(path, encoding="utf-8").read().splitlines()
computed = needed = batches = 0


def translate(sentences, options=DecodeOptions(), numbers=None):
  """Translator.translate, counting row-steps."""
  global computed, needed, batches
  src = encode_sources(translator.tokenizers.src, sentences, translator.max_src_len)
  max_len = src.shape[1] + options.max_len_margin
  tokens = translator.decode(src, DecodeOptions(max_len=max_len))[0][:, 0]
  lengths = [min(len(strip(row)) + 1, max_len) for row in tokens]
  computed += len(sentences) * max(lengths)
  real = len(set(numbers))  # The rows padding a batch repeat its first line number.
  needed += sum(lengths[:real])
  batches += 1
  return [translator.tokenizers.tgt.decode(strip(row)) for row in tokens]


translator.translate = translate
translate_lines(translator, lines, DecodeOptions(beam_size=1), batch_size, progress=False,
                segment_over=None, batch_tokens=batch_tokens)
print(f"{len(lines)} sources, {batches} batches (batch_size {batch_size}, batch_tokens "
      f"{batch_tokens}): {computed} row-steps computed, {needed} needed "
      f"({needed / computed:.0%} of the computed ones)")
