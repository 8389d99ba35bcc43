"""A split tokenized once into flat token arrays on disk, then read by memory map.

Layout of a cache directory (written under a temporary name, renamed when complete):
  meta.json                      pair count, token dtype, tokenizer fingerprint, sides
  {src,tgt}.tokens               every pair's ids end to end (no <eos>), uint16 or int32
  {src,tgt}.offsets.npy          [pairs + 1] int64: pair i is tokens[offsets[i]:offsets[i+1]]

A cache of documents has one side, "text" (a document per record).

Nothing is held in memory beyond what a reader touches, so a corpus of any size opens at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from absl import logging

from transformer_jax.data import workers

SIDES = ("src", "tgt")
DOCUMENT_SIDES = ("text",)


class TokenCache:
  """Read access to a finished cache directory; picklable (memory maps reopen lazily)."""

  def __init__(self, directory: str | Path):
    self.directory = Path(directory)
    meta_path = self.directory / "meta.json"
    if not meta_path.exists():
      raise FileNotFoundError(f"{self.directory} is not a finished token cache (no meta.json)")
    self.meta = json.loads(meta_path.read_text())
    self.num_pairs = int(self.meta["num_pairs"])
    self._maps: dict[str, np.ndarray] = {}

  def __getstate__(self):
    return {"directory": self.directory, "meta": self.meta, "num_pairs": self.num_pairs,
            "_maps": {}}

  def tokens(self, side: str) -> np.ndarray:
    key = f"{side}.tokens"
    if key not in self._maps:
      self._maps[key] = np.memmap(self.directory / key, dtype=self.meta["dtype"], mode="r")
    return self._maps[key]

  def offsets(self, side: str) -> np.ndarray:
    key = f"{side}.offsets"
    if key not in self._maps:
      self._maps[key] = np.load(self.directory / f"{key}.npy", mmap_mode="r")
    return self._maps[key]

  def lengths(self, side: str) -> np.ndarray:
    """[pairs] token counts of one side (without <eos>), int32, in memory."""
    return np.diff(self.offsets(side)).astype(np.int32)

  def ids(self, side: str, i: int) -> np.ndarray:
    o = self.offsets(side)
    return np.asarray(self.tokens(side)[o[i]:o[i + 1]])


def fingerprint(tokenizer_files: list[Path]) -> str:
  """A short hash of the tokenizer files, so a cache is never read with another tokenizer."""
  h = hashlib.sha256()
  for path in tokenizer_files:
    h.update(path.read_bytes())
  return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class _EncodeChunk:
  """grain map: chunk index -> the chunk's pairs as flat ids and lengths, per side."""
  text: object  # sources.TextPairs
  tokenizers: tuple  # One tokenizer per side (tokenizer.Tokenizers for pairs).
  chunk_size: int
  dtype: str
  sides: tuple[str, ...] = SIDES

  def __call__(self, k: int) -> dict[str, np.ndarray]:
    indices = range(k * self.chunk_size, min((k + 1) * self.chunk_size, len(self.text)))
    out = {}
    texts = self.text.read(indices)[:len(self.sides)]  # Labelled texts: not their labels.
    for side, sentences, tok in zip(self.sides, texts, self.tokenizers, strict=True):
      ids = tok.encode(sentences)
      out[f"{side}_len"] = np.fromiter(map(len, ids), np.int64, len(ids))
      out[side] = np.fromiter(itertools.chain.from_iterable(ids), self.dtype,
                              int(out[f"{side}_len"].sum()))
    return out


def build(directory: str | Path, text, tokenizers, tokenizer_fingerprint: str,
          num_workers: int, chunk_size: int = 4096,
          sides: tuple[str, ...] = SIDES) -> TokenCache:
  """Tokenizes every pair of `text` (a sources.TextPairs) into a cache at `directory`, with
  `num_workers` grain worker processes (0, or a split of under 16 chunks: in this process,
  since starting workers costs seconds); returns it opened. `tokenizers` and `sides` name one
  tokenizer and one side per text of a record (DOCUMENT_SIDES for documents).

  A finished cache is reused; an unfinished one (a crash mid-way) is never read.
  """
  directory = Path(directory)
  if (directory / "meta.json").exists():
    cache = TokenCache(directory)
    if cache.meta.get("tokenizer") != tokenizer_fingerprint:
      raise ValueError(f"token cache {directory} was built with another tokenizer")
    return cache
  vocab = max(tok.vocab_size for tok in tokenizers)
  dtype = "uint16" if vocab <= 2 ** 16 else "int32"
  num_chunks = -(-len(text) // chunk_size)
  num_workers = num_workers if num_chunks >= 16 else 0
  tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  start = time.perf_counter()
  try:
    done = _write(tmp, text, tokenizers, tokenizer_fingerprint, chunk_size, dtype, num_workers,
                  start, sides)
  except BaseException:  # An error or an interruption: no unfinished cache is left behind.
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  directory.parent.mkdir(parents=True, exist_ok=True)
  try:
    tmp.rename(directory)
  except OSError:  # Another process finished the same cache first.
    shutil.rmtree(tmp, ignore_errors=True)
  logging.info("Tokenized %s: %d %s in %.1f s into %s", text.split, done,
               "documents" if sides == DOCUMENT_SIDES else "pairs",
               time.perf_counter() - start, directory)
  return TokenCache(directory)


def _write(tmp: Path, text, tokenizers, tokenizer_fingerprint: str, chunk_size: int, dtype: str,
           num_workers: int, start: float, sides: tuple[str, ...]) -> int:
  """Writes the cache's files into `tmp`, meta.json last; returns the number of records."""
  num_chunks = -(-len(text) // chunk_size)
  lengths = {side: [] for side in sides}
  last_log, done = start, 0
  files = {side: open(tmp / f"{side}.tokens", "wb") for side in sides}
  try:
    it = workers.OrderedMap(
        0, num_chunks, _EncodeChunk(text, tuple(tokenizers), chunk_size, dtype, sides),
        num_workers)
    for _ in range(num_chunks):
      chunk = next(it)
      for side in sides:
        files[side].write(chunk[side].tobytes())
        lengths[side].append(chunk[f"{side}_len"])
      done += len(chunk[f"{sides[0]}_len"])
      if time.perf_counter() - last_log > 10:
        last_log = time.perf_counter()
        logging.info("Tokenizing %s: %d of %d pairs (%.0f pairs/s)", text.split, done, len(text),
                     done / (last_log - start))
    it.close()
  finally:
    for f in files.values():
      f.close()
  for side in sides:
    lens = np.concatenate(lengths[side]) if lengths[side] else np.zeros(0, np.int64)
    np.save(tmp / f"{side}.offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
  meta = {"num_pairs": done, "dtype": dtype, "tokenizer": tokenizer_fingerprint,
          "split": text.split, "sides": list(sides)}
  (tmp / "meta.json").write_text(json.dumps(meta))
  return done
