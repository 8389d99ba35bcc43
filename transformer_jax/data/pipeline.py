"""Tokenized examples and the grain pipelines that batch them.

An example is three int32 arrays: `inputs` (source + <eos>), `decoder_inputs` (<bos> + target)
and `targets` (target + <eos>). Every batch, packed or padded, has the same fixed shape
[batch, max_len] and carries `*_segment_ids` (0 = padding) and `*_positions`, so the train
step compiles once. `load_examples` goes from a config to tokenized examples of both splits.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import grain
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
from absl import logging

from transformer_jax.data import sources
from transformer_jax.data.tokenizer import BOS, EOS, Tokenizers, train_tokenizers

FEATURES = ("inputs", "decoder_inputs", "targets")


@dataclasses.dataclass(frozen=True)
class LengthStats:
  total: int
  kept: int
  truncated: int
  dropped: int


def tokenize(pairs: list[tuple[str, str]], tokenizers: Tokenizers, max_len: int,
             overlong: str = "drop") -> tuple[list[dict[str, np.ndarray]], LengthStats]:
  """Encodes sentence pairs; pairs longer than `max_len` tokens (with <eos>) are dropped or
  truncated, and the count is returned (the caller logs it)."""
  if overlong not in ("drop", "truncate"):
    raise ValueError(f"data.overlong must be 'drop' or 'truncate', got {overlong!r}")
  src_ids = tokenizers.src.encode([p[0] for p in pairs])
  tgt_ids = tokenizers.tgt.encode([p[1] for p in pairs])
  examples, truncated, dropped = [], 0, 0
  for src, tgt in zip(src_ids, tgt_ids):
    src, tgt = list(src) + [EOS], list(tgt) + [EOS]
    if not src[:-1] or not tgt[:-1]:
      dropped += 1
      continue
    if max(len(src), len(tgt)) > max_len:
      if overlong == "drop":
        dropped += 1
        continue
      truncated += 1
      src, tgt = src[:max_len], tgt[:max_len]
    examples.append({
        "inputs": np.asarray(src, np.int32),
        "decoder_inputs": np.asarray([BOS] + tgt[:-1], np.int32),
        "targets": np.asarray(tgt, np.int32),
    })
  return examples, LengthStats(len(pairs), len(examples), truncated, dropped)


def log_stats(split: str, stats: LengthStats, max_len: int) -> None:
  logging.info("%s: %d of %d pairs kept; %d dropped (empty or over %d tokens), %d truncated",
               split, stats.kept, stats.total, stats.dropped, max_len, stats.truncated)


def _pad(example: dict[str, np.ndarray], max_len: int) -> dict[str, np.ndarray]:
  """One example as a row of a padded batch, with segment ids and positions."""
  out = {}
  for key in FEATURES:
    n = len(example[key])
    out[key] = np.pad(example[key], (0, max_len - n))
    if key != "decoder_inputs":
      out[f"{key}_segment_ids"] = (np.arange(max_len) < n).astype(np.int32)
      out[f"{key}_positions"] = np.where(np.arange(max_len) < n, np.arange(max_len), 0).astype(
          np.int32)
  return out


def train_dataset(examples, *, batch_size: int, max_len: int, seed: int, packing: bool,
                  process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """Endless, seeded, per-host training batches of `batch_size // process_count` rows.

  With `packing`, several sentences share a row (first-fit into `batch_size` bins); without,
  each sentence is padded to `max_len`. Every epoch is shuffled anew.
  """
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} is not divisible by {process_count} processes")
  local_batch = batch_size // process_count
  ds = grain.MapDataset.source(examples)[process_index::process_count]
  ds = ds.repeat().shuffle(seed=seed).to_iter_dataset()
  if packing:
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={k: max_len for k in FEATURES}, num_packing_bins=local_batch,
        seed=seed, shuffle_bins=True)
    ds = ds.map(_drop_redundant)
  else:
    ds = ds.map(lambda ex: _pad(ex, max_len))
  return ds.batch(local_batch, drop_remainder=True)


def _drop_redundant(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  # decoder_inputs share segments and positions with targets.
  packed.pop("decoder_inputs_segment_ids")
  packed.pop("decoder_inputs_positions")
  return packed


def eval_batches(examples, *, batch_size: int, max_len: int, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """Padded [batch_size // process_count, max_len] batches covering every example once.

  The last batch is filled with empty rows (segment id 0 everywhere), and every host gets the
  same number of batches, so shapes never change and collectives line up.
  """
  local_batch = batch_size // process_count
  num_batches = -(-len(examples) // batch_size)
  mine = examples[process_index::process_count]
  rows = [_pad(ex, max_len) for ex in mine]
  empty = _pad({k: np.zeros(0, np.int32) for k in FEATURES}, max_len)
  rows += [empty] * (num_batches * local_batch - len(rows))
  return [{k: np.stack([r[k] for r in rows[i:i + local_batch]]) for k in rows[0]}
          for i in range(0, len(rows), local_batch)]


def load_examples(config: ml_collections.ConfigDict, workdir: str | Path):
  """Prepares the dataset, fits (or reloads) the tokenizers, tokenizes both splits.

  The tokenizers are saved into `workdir` on first use and reloaded afterwards, so a resumed
  run and the decoder see exactly the same vocabulary.

  Returns:
    (tokenizers, train examples, eval examples, eval sentence pairs)
  """
  tfds_dir = config.tfds_dir or os.path.expanduser("~/tensorflow_datasets")

  def load():
    builder = sources.prepare(config.dataset, tfds_dir, config.data_dir or None)
    return (sources.pairs(builder, config.dataset, config.train_split),
            sources.pairs(builder, config.dataset, config.eval_split), Tokenizers.load(workdir))

  # With several hosts, the first prepares the data and fits the tokenizer, the others then
  # read both (the workdir and tfds_dir are on a shared filesystem).
  if jax.process_index() == 0:
    train_pairs, eval_pairs, tokenizers = load()
    if tokenizers is None:
      logging.info("Fitting a %s tokenizer on %d training pairs", config.tokenizer,
                   len(train_pairs))
      tokenizers = train_tokenizers(train_pairs, config.tokenizer, config.vocab_size)
      tokenizers.save(workdir)
    else:
      logging.info("Reusing the tokenizer saved in %s", workdir)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("data prepared")
    if jax.process_index() > 0:
      train_pairs, eval_pairs, tokenizers = load()
  out = [tokenizers]
  for split, pairs in ((config.train_split, train_pairs), (config.eval_split, eval_pairs)):
    examples, stats = tokenize(pairs, tokenizers, config.max_len, config.overlong)
    log_stats(split, stats, config.max_len)
    if not examples:
      raise ValueError(f"{config.dataset} split {split!r} has no pair within max_len="
                       f"{config.max_len}")
    out.append(examples)
  return (*out, eval_pairs)
