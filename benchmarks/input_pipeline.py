"""Input-path throughput: real target tokens/s of packed batches from a prepared dataset, with
tokenization, for each grain worker count.

  python benchmarks/input_pipeline.py --config configs/synthetic.py \
      --set data.data_dir=data/synth1m --set data.tfds_dir=data/synth1m/tfds \
      --workers 1 2 --batches 200 --json out.json

For each worker count, two timed phases, as train.py runs them:
  tokenize: `pairs` training pairs (default: the whole split) read from the prepared tfds
            array_record files and tokenized into a fresh token cache, worker start-up
            included (`tokenize_main_process_cpu_s`: this process's CPU time meanwhile, the
            part that more workers do not divide);
  pack:     `batches` packed [batch_size, max_len] batches streamed from that cache (after the
            first, which pays the workers' start-up).
`tokens_per_s` is real target tokens (<eos> included, padding not) per second of each phase;
`combined_tokens_per_s` = 1 / (1/tokenize + 1/pack) is the rate of an input path that
tokenizes every pair once and packs it once, the cost of a first epoch. The tokenizer is
fitted (or reused) beforehand and not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.common import load_config  # noqa: E402
from transformer_jax import config as config_lib  # noqa: E402
from transformer_jax.data import pipeline, sources, token_cache  # noqa: E402


def run(config, pairs: int, workers: list[int], batches: int, scratch: Path) -> dict:
  cfg = config_lib.parse(config).data
  builder = sources.prepare_config(cfg)
  split = f"{cfg.train_split}[:{pairs}]" if pairs else cfg.train_split
  text = sources.TextPairs(builder, cfg.dataset, split)
  workdir = scratch / "workdir"
  workdir.mkdir(parents=True, exist_ok=True)
  tokenizers = pipeline.tokenizers_for(cfg, text, workdir)
  fp = token_cache.fingerprint(pipeline._tokenizer_files(workdir))
  rows = []
  for w in workers:
    start, cpu_start = time.perf_counter(), time.process_time()
    cache = token_cache.build(scratch / f"cache-{w}", text, tokenizers, fp, num_workers=w)
    tokenize_s = time.perf_counter() - start
    main_cpu_s = time.process_time() - cpu_start
    cache_tokens = int(np.sum(cache.lengths("tgt") + 1))
    stream = pipeline.pair_stream(cache, batch_size=cfg.batch_size, max_len=cfg.max_len,
                                  overlong=cfg.overlong, seed=0, num_workers=w)
    start = time.perf_counter()
    next(stream)
    first_s = time.perf_counter() - start
    real = 0
    start = time.perf_counter()
    for _ in range(batches):
      real += int((next(stream)["targets_segment_ids"] > 0).sum())
    pack_s = time.perf_counter() - start
    stream.close()
    tok_rate, pack_rate = cache_tokens / tokenize_s, real / pack_s
    rows.append({
        "workers": w, "pairs": cache.num_pairs, "target_tokens": cache_tokens,
        "tokenize_s": tokenize_s, "tokenize_tokens_per_s": tok_rate,
        "tokenize_pairs_per_s": cache.num_pairs / tokenize_s,
        "tokenize_main_process_cpu_s": main_cpu_s,
        "first_batch_s": first_s, "batches": batches, "pack_s": pack_s,
        "pack_tokens_per_s": pack_rate, "batches_per_s": batches / pack_s,
        "padding_fraction": 1 - real / (batches * cfg.batch_size * cfg.max_len),
        "combined_tokens_per_s": 1 / (1 / tok_rate + 1 / pack_rate)})
    print(f"workers {w}: tokenize {tok_rate:,.0f} target tokens/s ({cache.num_pairs / tokenize_s:,.0f}"
          f" pairs/s, {tokenize_s:.1f} s) | pack {pack_rate:,.0f} tokens/s ({batches / pack_s:.1f}"
          f" batches/s, padding {rows[-1]['padding_fraction']:.1%}) | combined "
          f"{rows[-1]['combined_tokens_per_s']:,.0f} tokens/s", flush=True)
  return {"dataset": cfg.dataset, "split": split, "batch": [cfg.batch_size, cfg.max_len],
          "vocab_size": tokenizers.tgt.vocab_size, "cpu_count": os.cpu_count(),
          "machine": cpu_model(),
          "date": time.strftime("%Y-%m-%d"), "results": rows}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/synthetic.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--pairs", type=int, default=0,
                      help="Training pairs to tokenize (0: the whole split).")
  parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--json", help="Write the results here.")
  args = parser.parse_args()
  config = load_config(args.config, args.set)
  config_lib.validate(config)
  scratch = Path(tempfile.mkdtemp(prefix="input_pipeline_"))
  try:
    result = run(config, args.pairs, args.workers, args.batches, scratch)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
