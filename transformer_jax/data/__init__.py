"""Data: tfds builders, tokenizers and grain pipelines."""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental import multihost_utils
import ml_collections
from absl import logging

from transformer_jax.data import pipeline, sources
from transformer_jax.data.tokenizer import Tokenizers, train_tokenizers


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
    examples, stats = pipeline.tokenize(pairs, tokenizers, config.max_len, config.overlong)
    pipeline.log_stats(split, stats, config.max_len)
    if not examples:
      raise ValueError(f"{config.dataset} split {split!r} has no pair within max_len="
                       f"{config.max_len}")
    out.append(examples)
  return (*out, eval_pairs)
