"""A classifier's input path: labelled texts tokenized once, one text a row, cut to max_len.

A row reads one text as `decoder_inputs` (<bos>, then its tokens: the classifier's head reads
the <bos> position) with `targets_segment_ids` 1 on its tokens (0 = padding) and
`targets_positions`; `labels` [rows] holds each row's label id (0 on an empty row, which no loss
counts). Texts of more than max_len - 1 tokens keep their first ones (counted and logged).
Training draws the texts in a new order each epoch; evaluation reads every text of the split
once, in order. NumPy only: runs in grain worker processes.
"""

from __future__ import annotations

import numpy as np
from absl import logging

from transformer_jax.data import documents, token_cache
from transformer_jax.data.documents import Chunks, Documents
from transformer_jax.data.packing import LM_FEATURES

FEATURES = LM_FEATURES + ("labels",)


def _fill(cache: token_cache.TokenCache, docs: Documents, labels: np.ndarray, ids: np.ndarray,
          rows: int, max_len: int) -> dict[str, np.ndarray]:
  """FEATURES of the texts `ids` (indices into `docs`) in rows 0, 1, ... of [rows, max_len]."""
  length = np.minimum(docs.lengths[ids], max_len)
  chunks = Chunks(ids, np.zeros_like(ids), length)
  out = documents.fill_rows(cache.tokens("text"), cache.offsets("text"), docs, chunks,
                            np.arange(len(ids)), np.zeros_like(ids), rows, max_len)
  out["labels"] = np.zeros(rows, np.int32)
  out["labels"][:len(ids)] = labels[docs.ids[ids]]
  return out


def subset(docs: Documents, fraction: float) -> Documents:
  """The first `fraction` of `docs` (at least one) in one fixed random order, in their own
  order: the same texts in every run, and a smaller fraction's among a larger one's."""
  if fraction >= 1.0:
    return docs
  keep = max(1, round(len(docs.ids) * fraction))
  pick = np.sort(np.random.default_rng(0).permutation(len(docs.ids))[:keep])
  return Documents(docs.ids[pick], docs.lengths[pick], docs.total)


class LabelledBlocks:
  """Global block g -> this host's rows of `batches_per_block` batches of labelled texts.

  Epoch e reads the texts in a permutation drawn from (seed, e), `rows` a batch; its last batch
  may hold fewer (the rest of its rows empty). As documents.DocumentBlocks: a block depends
  only on (seed, g), so any number of hosts or workers gives the same global batches; picklable
  and lazy. `fraction` < 1 reads only that share of the texts (`subset`)."""

  def __init__(self, cache, labels: np.ndarray, *, rows: int, row_start: int, row_stop: int,
               max_len: int, seed: int, batches_per_block: int = 64, fraction: float = 1.0,
               **_):
    self.cache, self.labels, self.rows, self.max_len = cache, labels, rows, max_len
    self.fraction = fraction
    self.row_start, self.row_stop, self.seed = row_start, row_stop, seed
    self.batches_per_block = batches_per_block
    self._docs: Documents | None = None

  def __getstate__(self):
    return {**self.__dict__, "_docs": None}

  @property
  def documents(self) -> Documents:
    if self._docs is None:
      self._docs = subset(documents.select(self.cache, "the training split"), self.fraction)
    return self._docs

  @property
  def blocks_per_epoch(self) -> int:
    batches = -(-len(self.documents.ids) // self.rows)
    return -(-batches // self.batches_per_block)

  def __call__(self, g: int) -> dict[str, np.ndarray]:
    epoch, b = divmod(int(g), self.blocks_per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self.documents.ids))
    per_block = self.batches_per_block * self.rows
    mine = order[b * per_block:(b + 1) * per_block]
    local = self.row_stop - self.row_start
    batches = [_fill(self.cache, self.documents, self.labels,
                     mine[start:start + self.rows][self.row_start:self.row_stop], local,
                     self.max_len)
               for start in range(0, len(mine), self.rows)]
    out = {k: np.stack([batch[k] for batch in batches]) for k in FEATURES}
    out["block"] = np.int64(g)
    return out


def eval_batches(cache: token_cache.TokenCache, labels: np.ndarray, *, batch_size: int,
                 max_len: int, process_index: int = 0, process_count: int = 1,
                 **_) -> list[dict[str, np.ndarray]]:
  """[batch_size // process_count, max_len] batches holding every text of the split once, in
  order; every host gets the same number of batches (its missing rows empty)."""
  docs = documents.select(cache, "the evaluation split")
  local = batch_size // process_count
  first = process_index * local
  return [_fill(cache, docs, labels, np.arange(len(docs.ids))[start:start + batch_size]
                [first:first + local], local, max_len)
          for start in range(0, len(docs.ids), batch_size)]


def log_texts(split: str, docs: Documents, max_len: int, labels: np.ndarray,
              names: tuple[str, ...]) -> None:
  counts = np.bincount(labels[docs.ids], minlength=len(names))
  logging.info("%s: %d of %d texts with text, %d cut to %d tokens; labels %s", split,
               len(docs.ids), docs.total, int(np.sum(docs.lengths > max_len)), max_len,
               ", ".join(f"{name} {n}" for name, n in zip(names, counts)))
