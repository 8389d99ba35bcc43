"""Does the train step's time follow the token ids? One compiled step per variant, timed on
batches that each change one property of real packed text:

  python benchmarks/token_ids.py --config configs/synthetic.py --data_dir data/synth300k \\
      --tfds_dir data/synth300k/tfds --variant model.embed_grad=scatter \\
      --variant model.embed_grad=auto --json OUT/token_ids.json

| batch | tokens | rows |
|---|---|---|
| packed | real | packed (several sentences a row), as train.py trains |
| one_per_row | real | one sentence a row, then padding |
| random_packed | uniform random ids | the packed batches' segments |
| repeated_pad | real, the padding replaced by one repeated id | full rows, one segment each |
| random_full | uniform random ids | full rows, one sentence each (train_step.py's control) |

Every batch has the config's rows x max_len shape, so each variant compiles once; the batches
are timed round-robin (packed, one_per_row, ..., packed, ...) so that all see the same machine
load. A step whose cost follows the ids (a scatter-add whose colliding ids serialise its
atomics, as the embedding gradient's did on GPUs) is slower on the real-token rows than on the
random ones; a step that does not is as fast on all five, up to what packing changes.
Prints the median step time per (variant, batch) and writes it with the spread as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import load_config  # noqa: E402
from benchmarks.train_step import real_batches, synthetic_batch, train_setup  # noqa: E402
from transformer_jax import sharding  # noqa: E402

BATCHES = ("packed", "one_per_row", "random_packed", "repeated_pad", "random_full")
TOKENS = ("inputs", "decoder_inputs", "targets")


def probe_batches(config, count: int, seed: int = 0) -> dict[str, list[dict]]:
  """{batch kind: `count` batches} of BATCHES from the config's corpus (see the module doc)."""
  rows, length, vocab = config.data.batch_size, config.data.max_len, config.data.vocab_size
  rng = np.random.default_rng(seed)
  packed = real_batches(config, rows, True, count)
  padded = real_batches(config, rows, False, count)

  def random_ids(batch):  # Uniform ids where the batch has tokens, its segments kept.
    out = dict(batch)
    for key in TOKENS:
      out[key] = np.where(batch[key] > 0, rng.integers(4, vocab, batch[key].shape),
                          0).astype(np.int32)
    return out

  def full_rows(batch, pad_id: int = 5):  # Padding becomes one repeated id; one segment a row.
    out = {key: np.where(batch[key] > 0, batch[key], pad_id).astype(np.int32) for key in TOKENS}
    ones = np.ones((rows, length), np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (rows, 1))
    out.update(inputs_segment_ids=ones, targets_segment_ids=ones, inputs_positions=positions,
               targets_positions=positions)
    return out

  return {"packed": packed, "one_per_row": padded,
          "random_packed": [random_ids(b) for b in packed],
          "repeated_pad": [full_rows(b) for b in padded],
          "random_full": [synthetic_batch(rows, length, vocab, seed=i) for i in range(count)]}


def time_variant(config, batches: dict[str, list[dict]], repeats: int) -> dict[str, dict]:
  """Compiles the config's train step once and times it on every kind of batch, round-robin;
  {kind: {"median_ms", "p10_ms", "p90_ms", "steps"}}."""
  _, mesh, state, p_train = train_setup(config)
  times = {kind: [] for kind in batches}
  with sharding.mesh_context(mesh):
    placed = {kind: [sharding.global_batch(b, mesh) for b in bs] for kind, bs in batches.items()}
    compiled = p_train.lower(state, placed["packed"][0]).compile()
    for kind, bs in placed.items():  # Warm-up: each kind's batches once.
      for b in bs:
        state, metrics = compiled(state, b)
    jax.block_until_ready(metrics)
    for r in range(repeats):
      for kind, bs in placed.items():
        start = time.perf_counter()
        state, metrics = compiled(state, bs[r % len(bs)])
        jax.block_until_ready(metrics)
        times[kind].append(time.perf_counter() - start)
  return {kind: {"median_ms": 1e3 * float(np.median(t)),
                 "p10_ms": 1e3 * float(np.percentile(t, 10)),
                 "p90_ms": 1e3 * float(np.percentile(t, 90)), "steps": len(t)}
          for kind, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/fra_eng.py")
  parser.add_argument("--data_dir", default=None, help="the corpus's local files (default: "
                      "the config's data.data_dir; empty: download)")
  parser.add_argument("--tfds_dir", default=None)
  parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,...]",
                      help="config overrides of one variant (repeatable; default: the config "
                      "as it is)")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="an override for every variant")
  parser.add_argument("--batches", type=int, default=4, help="batches of each kind")
  parser.add_argument("--repeats", type=int, default=20, help="timed steps of each kind")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  base = load_config(args.config, args.set)
  if args.data_dir is not None:
    base.data.data_dir = args.data_dir
  if args.tfds_dir is not None:
    base.data.tfds_dir = args.tfds_dir
  batches = probe_batches(base, args.batches)
  results = {}
  for variant in args.variant or [""]:
    config = load_config(args.config, args.set + [v for v in variant.split(",") if v])
    config.data.update(data_dir=base.data.data_dir, tfds_dir=base.data.tfds_dir)
    results[variant or "config"] = time_variant(config, batches, args.repeats)

  device = jax.devices()[0]
  print(f"device: {device.device_kind} x{jax.device_count()}, jax {jax.__version__}; "
        f"{args.config} {' '.join(args.set)}: {base.data.batch_size} x {base.data.max_len}, "
        f"{base.model.dtype}; median ms over {args.repeats} steps a batch kind")
  print("| variant | " + " | ".join(BATCHES) + " |")
  print("|---" * (len(BATCHES) + 1) + "|")
  for variant, row in results.items():
    print(f"| {variant} | " + " | ".join(f"{row[k]['median_ms']:.1f}" for k in BATCHES) + " |")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"device": device.device_kind, "device_count": jax.device_count(),
         "jax": jax.__version__, "config": args.config, "set": args.set,
         "batch": [base.data.batch_size, base.data.max_len], "repeats": args.repeats,
         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
  main()
