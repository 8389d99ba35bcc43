"""The language model's packing against grain's two packers, on one epoch of the same documents.

  python benchmarks/lm_packing.py --config configs/lm_shakespeare.py \
      --set data.data_dir=data/shakespeare --json OUT.json

Three ways to turn the training documents (token streams ending in <eos>) into [rows, max_len]
batches, each timed over one epoch on one core:
  ours         documents.DocumentBlocks: chunks of at most max_len cut at moving offsets,
               packed first-fit, one segment each (positions restart, no attention across)
  concat_split grain's ConcatThenSplitIterDataset: the streams laid end to end and cut every
               max_len tokens (rows full; a row's documents are told apart by segment ids)
  first_fit    grain's FirstFitPackIterDataset over the same chunks as ours (unshifted)
It reports batches, the fraction of token slots holding a real token, tokens/s, and the longest
context a row gives a token (ours restarts at each chunk; concat_split at each document).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks.common import load_config  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from transformer_jax import config as config_lib  # noqa: E402
from transformer_jax.data import documents, pipeline  # noqa: E402
from transformer_jax.data.tokenizer import EOS  # noqa: E402


def _streams(cache) -> list[np.ndarray]:
  docs = documents.select(cache, "the training split")
  tokens, offsets = cache.tokens("text"), cache.offsets("text")
  return [np.append(np.asarray(tokens[offsets[i]:offsets[i] + n - 1], np.int32), EOS)
          for i, n in zip(docs.ids, docs.lengths)]


def _report(name, seconds, batches, real, capacity) -> dict:
  out = {"seconds": round(seconds, 2), "batches": batches,
         "fill": round(real / capacity, 4), "tokens_per_sec": round(real / seconds)}
  print(name, json.dumps(out), flush=True)
  return out


def ours(cache, rows, max_len) -> dict:
  blocks = documents.DocumentBlocks(cache, rows=rows, row_start=0, row_stop=rows,
                                    max_len=max_len, seed=0)
  start = time.perf_counter()
  batches = real = 0
  for g in range(blocks.blocks_per_epoch):
    block = blocks(g)
    batches += len(block["targets"])
    real += int((block["targets_segment_ids"] > 0).sum())
  return _report("ours", time.perf_counter() - start, batches, real,
                 batches * rows * max_len)


def concat_split(streams, rows, max_len) -> dict:
  import grain
  from grain import experimental as ge
  start = time.perf_counter()
  ds = grain.MapDataset.source([{"targets": s} for s in streams]).to_iter_dataset()
  ds = ge.ConcatThenSplitIterDataset(ds, length_struct={"targets": max_len}).batch(rows)
  batches = real = 0
  for batch in ds:
    batches += 1
    real += int((batch["targets_segment_ids"] > 0).sum())
  return _report("concat_split", time.perf_counter() - start, batches, real,
                 batches * rows * max_len)


def first_fit(cache, streams, rows, max_len) -> dict:
  import grain
  from grain import experimental as ge
  docs = documents.select(cache, "the training split")
  chunks = documents.cut(docs.lengths, max_len)
  start = time.perf_counter()
  items = [{"targets": streams[d][s:s + n]}
           for d, s, n in zip(chunks.doc, chunks.start, chunks.length)]
  order = np.random.default_rng(0).permutation(len(items))
  ds = grain.MapDataset.source([items[i] for i in order]).to_iter_dataset()
  ds = ge.FirstFitPackIterDataset(ds, length_struct={"targets": max_len},
                                  num_packing_bins=rows).batch(rows)
  batches = real = 0
  for batch in ds:
    batches += 1
    real += int((batch["targets_segment_ids"] > 0).sum())
  return _report("first_fit", time.perf_counter() - start, batches, real,
                 batches * rows * max_len)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_shakespeare.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  cfg = config_lib.parse(load_config(args.config, args.set))
  data = pipeline.prepare_documents(cfg.data, tempfile.mkdtemp(prefix="lm_packing-"))
  rows, max_len = cfg.data.batch_size, cfg.data.max_len
  streams = _streams(data.train)
  record = {"command": "python benchmarks/lm_packing.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
            "documents": len(streams), "tokens": int(sum(map(len, streams))),
            "batch": f"{rows} x {max_len}",
            "ours": ours(data.train, rows, max_len),
            "concat_split": concat_split(streams, rows, max_len),
            "first_fit": first_fit(data.train, streams, rows, max_len)}
  print(json.dumps(record, indent=1))
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
