"""A fine-tuned classifier restored from a workdir, labelling texts: each text is read as in
training (<bos>, then its tokens, cut to data.max_len) and its labels' probabilities reported."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.data.tokenizer import BOS
from transformer_jax.decoding.options import InferenceError
from transformer_jax.runs import restore

ROWS = 64  # Texts a call of the model reads.


class Classifier:
  """Restores a workdir's classifier and labels texts."""

  def __init__(self, workdir: str | Path, step: int | None = None):
    run = restore.restore(workdir, "classifier", "classify", step)
    self.model, self.step, self.params = run.model, run.step, run.params
    self.labels = run.run.labels()
    self.tokenizer, self.max_len = run.tokenizers.tgt, run.config.data.max_len

  @functools.partial(jax.jit, static_argnums=0)
  def _probabilities(self, params, tokens):
    return jax.nn.softmax(self.model.apply({"params": params}, tokens), axis=-1)  # [B, labels]

  def probabilities(self, texts: list[str]) -> np.ndarray:
    """[texts, labels] probabilities, the labels in `self.labels`' order. A text of more than
    max_len - 1 tokens is read up to there, as in training (counted in the log)."""
    for number, text in enumerate(texts, 1):
      if not text.strip():
        raise InferenceError(f"text {number} is empty: nothing to classify")
    rows = [[BOS] + ids for ids in self.tokenizer.encode(texts)]
    cut = sum(len(r) > self.max_len for r in rows)
    if cut:
      logging.info("%d of %d texts cut to their first %d tokens (data.max_len)", cut, len(rows),
                   self.max_len - 1)
    rows = [r[:self.max_len] for r in rows]
    out = []
    for start in range(0, len(rows), ROWS):
      batch = rows[start:start + ROWS]
      width = min(self.max_len, -(-max(map(len, batch)) // 8) * 8)  # Few distinct shapes.
      tokens = np.zeros((ROWS, width), np.int32)
      for i, r in enumerate(batch):
        tokens[i, :len(r)] = r
      out.append(np.asarray(self._probabilities(self.params, jnp.asarray(tokens)))[:len(batch)])
    return np.concatenate(out)

  def classify(self, texts: list[str]) -> list[str]:
    """The likeliest label of each text."""
    return [self.labels[i] for i in np.argmax(self.probabilities(texts), axis=-1)]
