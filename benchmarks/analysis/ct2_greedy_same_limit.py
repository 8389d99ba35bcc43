"""Why greedy outputs of CTranslate2 and ours differ in decode_vs_ctranslate2.py: counts the
lines that differ with CTranslate2's output limit there (max_len + 10) and with ours (the
source's width, rounded up to 8, + 10). Usage:
  python benchmarks/analysis/ct2_greedy_same_limit.py WORKDIR CT2_DIR INPUT
CT2_DIR: `export --workdir WORKDIR --to ctranslate2 CT2_DIR`."""

import sys

import ctranslate2
import sentencepiece as spm

from transformer_jax.decoding.generation import DecodeOptions
from transformer_jax.decoding.translator import Translator, translate_lines

workdir, ct2_dir, path = sys.argv[1:4]
lines = open(path, encoding="utf-8").read().splitlines()
translator = Translator(workdir)
max_len = translator.max_src_len
ours = translate_lines(translator, lines, DecodeOptions(beam_size=1), 64, False,
                       batch_tokens=1024)
sp = spm.SentencePieceProcessor(model_file=f"{ct2_dir}/tokenizer.model")
sources = [sp.encode(line, out_type=str) for line in lines]
engine = ctranslate2.Translator(ct2_dir, intra_threads=2)


def theirs(indices, limit):
  results = engine.translate_batch([sources[i] for i in indices], beam_size=1,
                                   max_input_length=max_len, max_decoding_length=limit,
                                   max_batch_size=64)
  return {i: sp.decode_pieces(r.hypotheses[0]) for i, r in zip(indices, results)}


everything = list(range(len(lines)))
benchmark_limit = theirs(everything, max_len + 10)
limits = [-(-min(len(s) + 1, max_len) // 8) * 8 + 10 for s in sources]
our_limit = {}
for limit in sorted(set(limits)):
  our_limit.update(theirs([i for i in everything if limits[i] == limit], limit))
for name, out in (("CTranslate2's limit, max_len + 10", benchmark_limit),
                  ("our limit, width + 10", our_limit)):
  print(f"{name}: {sum(ours[i] != out[i] for i in everything)} of {len(lines)} lines differ")
