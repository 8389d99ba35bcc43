"""A trained masked language model restored from a workdir, predicting the tokens behind the
`[MASK]`s of texts: the encoder reads each text with the mask id at every `[MASK]`, and the
likeliest pieces at those positions are reported."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import UNK
from transformer_jax.decoding.options import InferenceError
from transformer_jax.runs import restore
from transformer_jax.models import build

MASK = "[MASK]"


class Filler:
  """Restores a workdir's masked language model and fills the masks of texts."""

  def __init__(self, workdir: str | Path, step: int | None = None):
    run = restore.restore(workdir, "encoder_only", "fill", step)
    self.model, self.step, self.params = run.model, run.step, run.params
    self.tokenizer, self.max_len = run.tokenizers.tgt, run.config.data.max_len
    self.mask_id = build.mask_id(self.tokenizer.vocab_size)

  def encode(self, text: str, number: int) -> list[int]:
    """The ids of a text, the mask id at each `[MASK]` (the spaces just before one are the
    masked piece's); an error naming text `number` where it holds no mask or is longer than the
    model reads."""
    parts = text.split(MASK)
    if len(parts) == 1:
      raise InferenceError(f"text {number} holds no {MASK}: nothing to fill")
    ids = []
    for i, part in enumerate(parts):
      if i:
        ids.append(self.mask_id)
      if i < len(parts) - 1:
        # The tokenizer spells a word with the space before it (" winter"): the mask stands
        # for that piece, rather than leaving a lone space piece in front of it (as an
        # exported tokenizer's [MASK], lstrip).
        part = part.rstrip(" ")
      ids.extend(self.tokenizer.encode([part])[0] if part else [])
    if len(ids) > self.max_len:
      raise InferenceError(f"text {number} has {len(ids)} tokens: the model reads at most "
                           f"{self.max_len} (data.max_len)")
    return ids

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def _top(self, params, tokens, k):
    logits = self.model.apply({"params": params}, tokens)  # [B, T, V]
    # Only the tokenizer's pieces (not padding, <bos>, <eos>, the mask id or the padded rows).
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where((ids >= UNK) & (ids < self.tokenizer.vocab_size), logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jax.lax.top_k(probs, k)

  def fill(self, texts: list[str], top_k: int = 5) -> list[list[list[tuple[str, float]]]]:
    """For each text, for each of its masks in order, the `top_k` likeliest pieces (as text)
    and their probabilities."""
    if top_k < 1:
      raise InferenceError(f"--top_k must be at least 1, got {top_k}")
    pieces = self.tokenizer.vocab_size - UNK  # What a mask can be: _top's candidates.
    if top_k > pieces:
      raise InferenceError(f"--top_k {top_k} is over the {pieces} pieces a mask can be (the "
                           "run's tokenizer, without its special tokens)")
    rows = [self.encode(text, number) for number, text in enumerate(texts, 1)]
    width = -(-max(map(len, rows)) // 8) * 8  # Few distinct shapes, few compilations.
    tokens = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    probs, ids = map(np.asarray, self._top(self.params, jnp.asarray(tokens), top_k))
    text_of = lambda i: self.tokenizer.decode([int(i)])  # A piece as text, its spaces kept.
    return [[[(text_of(i), float(p)) for i, p in zip(ids[b, t], probs[b, t])]
             for t in np.flatnonzero(tokens[b] == self.mask_id)] for b in range(len(rows))]
