"""A language model's input path: documents tokenized once, cut into chunks, packed into rows.

A document is one token stream: its tokens, then <eos>. A chunk is a run of at most max_len
tokens of one stream; chunks are packed first-fit into [rows, max_len] rows (packing.first_fit),
one segment each:

  decoder_inputs   the token before each target (<bos> before a document's first token)
  targets          the stream's tokens            targets_segment_ids, targets_positions

Segment ids number a row's chunks from 1 (0 = padding) and positions restart at 0 in each, so
no token attends across chunks. Training cuts a long document every max_len tokens from an
offset drawn anew each epoch (the cut points move between epochs); evaluation cuts from 0 and
predicts every token of the split exactly once. NumPy only: runs in grain worker processes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from absl import logging

from transformer_jax.config import DataConfig
from transformer_jax.data import packing, token_cache
from transformer_jax.data.packing import LM_FEATURES
from transformer_jax.data.tokenizer import BOS, EOS, SentencePiece, Tokenizers
from transformer_jax.errors import UserError


class NoDocumentsError(UserError, ValueError):
  """A split has no document with a token to train or evaluate on."""


@dataclasses.dataclass(frozen=True)
class Documents:
  """The non-empty documents of a token cache (ids into it) and their stream lengths."""
  ids: np.ndarray  # [docs]
  lengths: np.ndarray  # [docs] tokens + 1 (<eos>)
  total: int  # Documents in the cache, empty ones included.


def select(cache: token_cache.TokenCache, what: str) -> Documents:
  """The documents with at least one token; NoDocumentsError naming `what` where none is."""
  n = cache.lengths("text")
  ids = np.flatnonzero(n > 0)
  if not len(ids):
    raise NoDocumentsError(f"{what} holds no document with text ({len(n)} documents, all "
                           "empty): check the corpus")
  return Documents(ids, n[ids].astype(np.int64) + 1, total=len(n))


@dataclasses.dataclass(frozen=True)
class Chunks:
  """Runs of document streams, all fields [chunks]."""
  doc: np.ndarray  # Index into Documents.
  start: np.ndarray  # Position of the first token in the stream.
  length: np.ndarray  # At least 1, at most max_len.


def cut(lengths: np.ndarray, max_len: int, shift: np.ndarray | None = None) -> Chunks:
  """Cuts streams of `lengths` tokens into chunks of at most `max_len`.

  Stream d is cut at shift[d] (where 0 < shift[d] < lengths[d]), then every max_len tokens
  after it; without `shift` at 0, max_len, 2 max_len, ... Chunks come in stream order.
  """
  lengths = np.asarray(lengths, np.int64)
  head = np.zeros_like(lengths) if shift is None else np.asarray(shift, np.int64)
  head = np.where((head > 0) & (head < lengths), head, 0)
  full = -(-(lengths - head) // max_len)  # Chunks after the head, per stream.
  per_doc = full + (head > 0)
  doc = np.repeat(np.arange(len(lengths)), per_doc)
  first = np.cumsum(per_doc) - per_doc
  k = np.arange(len(doc)) - first[doc]  # The chunk's index within its stream.
  has_head = head[doc] > 0
  start = np.where(has_head & (k == 0), 0, head[doc] + (k - has_head) * max_len)
  length = np.where(has_head & (k == 0), head[doc], np.minimum(max_len, lengths[doc] - start))
  return Chunks(doc, start, length)


def fill_rows(tokens: np.ndarray, offsets: np.ndarray, docs: Documents, chunks: Chunks,
              row: np.ndarray, offset: np.ndarray, rows: int, max_len: int
              ) -> dict[str, np.ndarray]:
  """LM_FEATURES -> [rows, max_len] int32 of `chunks` placed at (`row`, `offset`).

  Args:
    tokens, offsets: the cache's flat ids and [records + 1] offsets of the "text" side.
  """
  out = {k: np.zeros((rows, max_len), np.int32) for k in LM_FEATURES}
  owner, j = packing._spans(chunks.length)
  pos = chunks.start[owner] + j  # Position in the document's stream.
  doc = chunks.doc[owner]
  base, n = offsets[docs.ids[doc]], docs.lengths[doc] - 1  # n: the tokens before <eos>.
  at = lambda p: np.asarray(tokens[base + np.clip(p, 0, n - 1)], np.int32)
  dest = row[owner] * max_len + offset[owner] + j
  out["targets"].flat[dest] = np.where(pos == n, EOS, at(pos))
  out["decoder_inputs"].flat[dest] = np.where(pos == 0, BOS, at(pos - 1))
  out["targets_segment_ids"].flat[dest] = packing._segments(row)[owner]
  out["targets_positions"].flat[dest] = j
  return out


def _plans(lengths: np.ndarray, rows: int, max_len: int, pack: bool) -> list[packing.Plan]:
  return (packing.first_fit(lengths, lengths, rows, max_len) if pack
          else packing.one_per_row(len(lengths), rows))


class DocumentBlocks:
  """Global block g -> this host's rows of every batch packed from that block of chunks.

  Epoch e cuts every document from a seeded random offset (`cut`), permutes the chunks and
  splits them into blocks of about `batches_per_block` batches; an epoch has a fixed number
  of blocks (the last ones may hold fewer batches, or none). Like packing.TrainBlocks: the plan
  of a block depends only on (seed, g) and the lengths, so the global batches are the same for
  any number of hosts or workers; picklable and lazy.
  """

  def __init__(self, cache, *, rows: int, row_start: int, row_stop: int, max_len: int,
               seed: int, packing: bool = True, batches_per_block: int = 64):
    self.cache, self.rows, self.max_len, self.seed = cache, rows, max_len, seed
    self.row_start, self.row_stop, self.packing = row_start, row_stop, packing
    self.batches_per_block = batches_per_block
    self._docs: Documents | None = None
    self._epoch: tuple[int, Chunks, np.ndarray] | None = None

  def __getstate__(self):
    return {**self.__dict__, "_docs": None, "_epoch": None}

  @property
  def documents(self) -> Documents:
    if self._docs is None:
      self._docs = select(self.cache, "the training split")
    return self._docs

  @property
  def block_size(self) -> int:
    """Chunks per block: about `batches_per_block` full batches."""
    per_chunk = min(self.max_len, float(np.mean(self.documents.lengths))) if self.packing \
        else self.max_len
    return max(self.rows, int(self.batches_per_block * self.rows * self.max_len / per_chunk))

  @property
  def blocks_per_epoch(self) -> int:
    """Enough blocks for the most chunks an epoch can have (one more per cut document)."""
    most = int(np.sum(-(-self.documents.lengths // self.max_len) + 1))
    return -(-most // self.block_size)

  def epoch_chunks(self, epoch: int) -> tuple[Chunks, np.ndarray]:
    """The chunks of `epoch` and their order."""
    if self._epoch is None or self._epoch[0] != epoch:
      lengths = self.documents.lengths
      shift = np.random.default_rng([self.seed, epoch, 2]).integers(0, self.max_len,
                                                                    len(lengths))
      chunks = cut(lengths, self.max_len, shift)
      order = np.random.default_rng([self.seed, epoch]).permutation(len(chunks.doc))
      self._epoch = (epoch, chunks, order)
    return self._epoch[1], self._epoch[2]

  def __call__(self, g: int) -> dict[str, np.ndarray]:
    epoch, b = divmod(int(g), self.blocks_per_epoch)
    chunks, order = self.epoch_chunks(epoch)
    size = self.block_size
    mine = order[b * size:(b + 1) * size]
    block = Chunks(chunks.doc[mine], chunks.start[mine], chunks.length[mine])
    local = self.row_stop - self.row_start
    tokens, offsets = self.cache.tokens("text"), self.cache.offsets("text")
    batches = []
    for plan in _plans(block.length, self.rows, self.max_len, self.packing):
      keep = (plan.row >= self.row_start) & (plan.row < self.row_stop)
      ex = plan.example[keep]
      batches.append(fill_rows(
          tokens, offsets, self.documents,
          Chunks(block.doc[ex], block.start[ex], block.length[ex]),
          plan.row[keep] - self.row_start, plan.src_offset[keep], local, self.max_len))
    out = {k: (np.stack([b[k] for b in batches]) if batches
               else np.zeros((0, local, self.max_len), np.int32)) for k in LM_FEATURES}
    out["block"] = np.int64(g)
    return out


def eval_batches(cache: token_cache.TokenCache, *, batch_size: int, max_len: int,
                 pack: bool = True, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """[batch_size // process_count, max_len] batches predicting every token of the split's
  documents (and each one's <eos>) once, cut from the start of each document. As
  pipeline.eval_batches: every host plans the same global batches and fills its own rows."""
  docs = select(cache, "the evaluation split")
  chunks = cut(docs.lengths, max_len)
  local = batch_size // process_count
  first = process_index * local
  tokens, offsets = cache.tokens("text"), cache.offsets("text")
  batches = []
  for plan in _plans(chunks.length, batch_size, max_len, pack):
    keep = (plan.row >= first) & (plan.row < first + local)
    ex = plan.example[keep]
    batches.append(fill_rows(tokens, offsets, docs,
                             Chunks(chunks.doc[ex], chunks.start[ex], chunks.length[ex]),
                             plan.row[keep] - first, plan.src_offset[keep], local, max_len))
  return batches


def characters(batches: list[dict[str, np.ndarray]], tokenizer: SentencePiece) -> int:
  """The characters of text that the real targets of `batches` stand for: a sum of losses over
  them, divided by this, is a loss per character that any tokenizer compares on."""
  per_id = np.asarray(tokenizer.characters(), np.int64)
  return int(sum(per_id[b["targets"]][b["targets_segment_ids"] > 0].sum() for b in batches))


def unigram_bits(train: token_cache.TokenCache, batches: list[dict[str, np.ndarray]],
                 vocab_size: int) -> float:
  """The bits a unigram model of the training split's tokens (<eos> included, add-one
  smoothed) spends on the real targets of `batches`: the baseline a language model beats."""
  docs = select(train, "the training split")
  counts = np.bincount(np.asarray(train.tokens("text")), minlength=vocab_size)[:vocab_size]
  counts = counts.astype(np.float64) + 1.0
  counts[EOS] += len(docs.ids)
  bits = -np.log2(counts / counts.sum())
  return float(sum(bits[b["targets"]][b["targets_segment_ids"] > 0].sum() for b in batches))


def fit_tokenizer(cfg: DataConfig, text) -> Tokenizers:
  """A lossless SentencePiece (newlines and spaces kept) fitted on lines of the training
  documents, taken in a fixed random order until `tokenizer_sample` lines."""
  order = np.random.default_rng(0).permutation(len(text))
  lines, read = [], 0
  while read < len(order) and len(lines) < cfg.tokenizer_sample:
    docs = text.read(order[read:read + 1000])[0]  # The texts (labelled texts: not the labels).
    read += len(docs)
    lines += [line + "\n" for doc in docs for line in doc.split("\n")]
  logging.info("Fitting a lossless SentencePiece of %d pieces on %d lines of %d of %d training "
               "documents", cfg.vocab_size, len(lines), read, len(text))
  sp = SentencePiece.train(lines, cfg.vocab_size, max_sentences=cfg.tokenizer_sample,
                           lossless=True)
  return Tokenizers(sp, sp)


def log_documents(split: str, docs: Documents, max_len: int) -> None:
  logging.info("%s: %d of %d documents with text, %d tokens with <eos> (%d rows of %d)", split,
               len(docs.ids), docs.total, int(docs.lengths.sum()),
               math.ceil(docs.lengths.sum() / max_len), max_len)
