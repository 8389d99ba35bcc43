"""The length figures behind the README's output-cap experiment: how many of run B's Tatoeba
hypotheses (beam 4, alpha 1.0) have at least source + 10 tokens when re-tokenized, and how
often fra.txt's targets are longer than their source + 10 tokens.
Usage, from the repository root:
  PYTHONPATH=. python benchmarks/analysis/output_lengths.py HYP"""
import sys
import zipfile

import numpy as np
import sentencepiece as spm

sp = spm.SentencePieceProcessor(model_file="runs/rB/tokenizer.model")
base = "../shared/data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng."
src = open(base + "eng", encoding="utf-8").read().splitlines()
hyp = open(sys.argv[1], encoding="utf-8").read().splitlines()
s = np.minimum([len(x) for x in sp.encode(src)], 63)  # translate truncates at max_len 64.
h = np.array([len(x) for x in sp.encode(hyp)])
print(f"Tatoeba: {np.sum(h >= s + 10)} of {len(src)} hypotheses have >= source + 10 tokens")

z = zipfile.ZipFile("../shared/data/fra-eng/fra-eng.zip")
text = z.read(next(n for n in z.namelist() if n.endswith("fra.txt"))).decode("utf-8")
pairs = [line.split("\t")[:2] for line in text.splitlines() if "\t" in line]
s = np.array([len(x) for x in sp.encode([p[0] for p in pairs])])
t = np.array([len(x) for x in sp.encode([p[1] for p in pairs])])
for lo in (10, 20, 30):
  m = s >= lo
  print(f"fra.txt, sources of >= {lo} tokens: {m.sum()} pairs, "
        f"{100 * np.mean(t[m] > s[m] + 10):.1f}% of targets longer than source + 10")
