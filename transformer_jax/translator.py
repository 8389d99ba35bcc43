"""A trained model restored from a workdir (config, tokenizer, the newest checkpoint that
verifies), with a jitted generate function.

Only the parameters are read from the checkpoint (not the optimizer state), onto whatever
devices this machine has.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import logging

from transformer_jax import errors, sentences, sharding
from transformer_jax.generation import (DecodeOptions, InferenceError, encode_sources, generate,
                                        strip)
from transformer_jax.workdir import Workdir


class Translator:
  """Restores a workdir's model and tokenizer and translates batches of sentences."""

  def __init__(self, workdir: str | Path, step: int | None = None, ema: bool = True):
    """`ema`: decode with the parameters' moving average where the run kept one (ema_decay >
    0), else with the parameters themselves."""
    run = Workdir(workdir)
    self.config, self.tokenizers, self.model = run.open()
    ckpt = run.checkpointer(read_only=True)
    mesh = sharding.make_mesh((-1, 1, 1))
    self.uses_ema = ema and self.config.step.ema_decay > 0
    key = "ema_params" if self.uses_ema else "params"
    try:
      if step is None:  # The newest that reads back and verifies.
        self.step, self.params = ckpt.restore_params_latest(self._abstract_params(), mesh, key)
      else:
        self.step = step
        self.params = ckpt.restore_params(step, self._abstract_params(), mesh, key)
    finally:
      ckpt.close()
    self.max_src_len = self.config.data.max_len
    self.max_output_len = 4 * self.max_src_len  # Longer outputs than this are refused.
    logging.info("Restored step %d from %s (%s)", self.step, run.checkpoints,
                 "the parameters' moving average" if self.uses_ema else "the parameters")

  @property
  def src_lang(self) -> str:
    """The source language's code (e.g. "en"), from the dataset the model was trained on."""
    from transformer_jax.data.sources import DATASETS  # tfds: imported only when asked.
    return DATASETS[self.config.data.dataset].src_lang

  def _abstract_params(self):
    dummy = jnp.ones((1, 2), jnp.int32)
    boxed = jax.eval_shape(self.model.init, jax.random.PRNGKey(0), dummy, dummy)["params"]
    return boxed  # Still boxed: the checkpointer turns the names into shardings.

  @functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
  def generate_ids(self, params, src, max_len, beam_size, alpha):
    """src [B, S] -> best output tokens [B, max_len]; compiled once per shape and options."""
    return generate(self.model, params, src, max_len, beam_size, alpha)

  def translate(self, sentences: list[str], options: DecodeOptions = DecodeOptions(),
                numbers: list[int] | None = None) -> list[str]:
    """`numbers`: the sentences' line numbers, for warnings (default: 1, 2, ...)."""
    src = encode_sources(self.tokenizers.src, sentences, self.max_src_len, numbers=numbers)
    max_len = options.max_len or src.shape[1] + options.max_len_margin
    tokens = np.asarray(self.generate_ids(self.params, src, max_len, options.beam_size,
                                       options.alpha))
    return [self.tokenizers.tgt.decode(strip(row)) for row in tokens]


def translate_lines(translator: Translator, lines: list[str], options: DecodeOptions,
                    batch_size: int, progress: bool = True, segment_over: int | None = None,
                    long_beam: tuple[int, int] | None = None) -> list[str]:
  """Translates many sentences, batched by similar length, in the input order; an empty (or
  blank) line translates to an empty line. A line of more than `segment_over` tokens (with
  <eos>) is translated sentence by sentence (sentences.py); None: no line is split.
  `long_beam` = (over, beam size): a line (or sentence of a split line) of more than `over`
  tokens is decoded with that beam size instead of `options.beam_size`."""
  numbers = owners = None
  if segment_over is not None:
    lengths = _token_lengths(translator, lines)
    pieces, owners = sentences.split_long(lines, lengths, segment_over, translator.src_lang)
    numbers = [i + 1 for i in owners]
  else:
    pieces = lines
  groups = [(range(len(pieces)), options)]
  if long_beam is not None:
    over, beam_size = long_beam
    is_long = [n > over for n in _token_lengths(translator, pieces)]
    groups = [([i for i, x in enumerate(is_long) if not x], options),
              ([i for i, x in enumerate(is_long) if x],
               dataclasses.replace(options, beam_size=beam_size))]
  translations = _translate_each(translator, pieces, groups, batch_size, progress, numbers)
  return translations if owners is None else sentences.join(translations, owners, len(lines))


def _token_lengths(translator: Translator, lines: list[str]) -> list[int]:
  """Source tokens of each line, with <eos>."""
  return [len(ids) + 1 for ids in translator.tokenizers.src.encode(lines)]


def _translate_each(translator: Translator, lines: list[str],
                    groups: list[tuple[Sequence[int], DecodeOptions]], batch_size: int,
                    progress: bool, numbers: list[int] | None = None) -> list[str]:
  """Translates the lines of each group (their indices) with the group's options.
  `numbers`: each line's number in warnings (default: its index + 1)."""
  numbers = numbers or list(range(1, len(lines) + 1))
  batches = []
  for indices, options in groups:
    order = sorted((i for i in indices if lines[i].strip()), key=lambda i: len(lines[i]))
    batches += [(order[i:i + batch_size], options) for i in range(0, len(order), batch_size)]
  out = [""] * len(lines)
  for batch, options in tqdm.tqdm(batches, desc="translating", unit="batch",
                                  disable=not progress):
    # Pad the batch to a full one so that every batch shares the compiled shape.
    texts = [lines[i] for i in batch]
    pad = batch_size - len(batch)
    results = translator.translate(texts + texts[:1] * pad, options,
                                   numbers=[numbers[i] for i in batch] + [numbers[batch[0]]] * pad)
    for i, text in zip(batch, results):
      out[i] = text
  return out


def split_pairs(workdir: str, split: str) -> tuple[list[str], list[str]]:
  """(sources, references) of a split of the dataset a workdir was trained on."""
  from transformer_jax.data import sources
  from transformer_jax.data.builders import DatasetError
  config = Workdir(workdir).load_config().data
  try:
    builder = sources.prepare(config.dataset, config.tfds_dir or os.path.expanduser(
        "~/tensorflow_datasets"), config.data_dir or None)
    pairs = sources.pairs(builder, config.dataset, split)
  except (DatasetError, FileNotFoundError, ValueError, KeyError) as e:
    raise InferenceError(f"--split {split} of {config.dataset} (data_dir="
                         f"{config.data_dir!r}) cannot be read: {errors.first_line(e)}"
                         ) from None
  if not pairs:
    raise InferenceError(f"--split {split} of {config.dataset} is empty")
  return [s for s, _ in pairs], [t for _, t in pairs]
