"""From a prepared dataset to the batches the train and eval steps eat.

`prepare` builds (once, on the first host) the tfds array_record files, the tokenizer (fitted on
a bounded sample of the training split) and a token-id cache of each split; nothing is held in
memory whole. `pair_stream` yields endless packed training batches made by grain worker
processes; its position is two integers of the global stream (block, batch), the same on every
host, so a checkpoint resumes on any number of hosts or workers. `eval_batches` packs the
evaluation split the same way, each pair once. Every batch has the fixed shape [rows, max_len] and
carries `*_segment_ids` (0 = padding) and `*_positions` (see `packing`), so steps compile once.
A language model's corpus of documents takes `prepare_documents`, `document_stream` and
`documents.eval_batches` (see `documents`); a classifier's labelled texts, `prepare_labelled`,
`labelled_stream` and `labelled.eval_batches`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

import numpy as np
from absl import logging

from transformer_jax.config import DataConfig
from transformer_jax.data import documents, labelled, packing, token_cache, workers
from transformer_jax.data.documents import DocumentBlocks
from transformer_jax.data.packing import FEATURES
from transformer_jax.data.tokenizer import HF_FILE, SPM_FILE, WORD_FILE, Tokenizers, train_tokenizers
from transformer_jax.errors import UserError


def cache_root(cfg: DataConfig) -> Path:
  """Tokenizers and token caches of this dataset made from this source (sources.source_key)."""
  from transformer_jax.data import sources  # tfds loads here, not on import.
  tfds_dir = sources.tfds_dir_of(cfg)
  return (Path(cfg.cache_dir or Path(tfds_dir) / "transformer_jax_cache") / cfg.dataset
          / sources.source_key(cfg.data_dir or None, (tfds_dir, cfg.cache_dir)))


@dataclasses.dataclass(frozen=True)
class Prepared:
  tokenizers: Tokenizers
  train: token_cache.TokenCache
  eval: token_cache.TokenCache
  bleu_pairs: list[tuple[str, str]]  # A fixed sample of the eval split, as text.
  # Labelled texts (a classifier's): the label names, and each text's label id of either split.
  label_names: tuple[str, ...] = ()
  train_labels: np.ndarray | None = None
  eval_labels: np.ndarray | None = None


def resolve_workers(num_workers: int | str) -> int:
  """`auto`: one grain worker per two CPU cores, at most 8 (0 means in-process)."""
  if num_workers == "auto":
    return max(1, min(8, (os.cpu_count() or 2) // 2))
  if int(num_workers) < 0:
    raise ValueError(f"num_workers={num_workers} must be 'auto' or a count >= 0")
  return int(num_workers)


def _split_dir(split: str) -> str:
  """A file name for a tfds split spec such as "train[:4000]"."""
  return re.sub(r"[^\w.-]+", "_", split) + "-" + hashlib.sha1(split.encode()).hexdigest()[:6]


def tokenizers_for(cfg: DataConfig, text, workdir: Path, tokenizer_from=None,
                   fit=None) -> Tokenizers:
  """The workdir's tokenizers; else those of `tokenizer_from` (what a fine-tuning run starts
  from: a workdir or a Hugging Face checkpoint, with `path` and `tokenizers()`), copied in;
  else the dataset cache's (copied in); else fitted (`fit(cfg, text)`; by default on a sample
  of at most `tokenizer_sample` training pairs spread evenly over the split), and saved in
  both."""
  tokenizers = Tokenizers.load(workdir)
  if tokenizers is not None:
    logging.info("Reusing the tokenizer saved in %s", workdir)
    return tokenizers
  if tokenizer_from is None and cfg.tokenizer == "huggingface":  # Never fitted here.
    raise UserError(f"{workdir} holds no {HF_FILE}, the tokenizer of the Hugging Face "
                    "checkpoint this run started from (run.init_from is read only before the "
                    "run's first checkpoint): put the file back, or start a new workdir")
  if tokenizer_from is not None:
    tokenizers = tokenizer_from.tokenizers()
    logging.info("Using the tokenizer of %s (what this run starts from)", tokenizer_from.path)
    tokenizers.save(workdir)
    return tokenizers
  # Keyed by what it is fitted on: the source (cache_root), the split, the sample, the kind.
  kind = cfg.tokenizer if fit is None else f"{cfg.tokenizer}-{fit.__name__}"
  shared = cache_root(cfg) / (f"tokenizer-{kind}-{cfg.vocab_size}-{cfg.tokenizer_sample}"
                             f"-{_split_dir(cfg.train_split)}")
  tokenizers = Tokenizers.load(shared)
  if tokenizers is None:
    tokenizers = (fit or _fit_on_pairs)(cfg, text)
    shared.mkdir(parents=True, exist_ok=True)
    tokenizers.save(shared)
  else:
    logging.info("Reusing the tokenizer saved in %s", shared)
  tokenizers.save(workdir)
  return tokenizers


def _fit_on_pairs(cfg: DataConfig, text) -> Tokenizers:
  n = len(text)
  indices = (np.arange(n) if n <= cfg.tokenizer_sample
             else np.linspace(0, n - 1, cfg.tokenizer_sample).astype(np.int64))
  src, tgt = [], []
  for start in range(0, len(indices), 10_000):
    s, t = text.read(indices[start:start + 10_000])
    src += s
    tgt += t
  logging.info("Fitting a %s tokenizer on %d of %d training pairs", cfg.tokenizer,
               len(indices), n)
  return train_tokenizers(list(zip(src, tgt)), cfg.tokenizer, cfg.vocab_size)


def _tokenizer_files(workdir: Path) -> list[Path]:
  return [p for p in (workdir / SPM_FILE, workdir / WORD_FILE, workdir / HF_FILE)
          if p.exists()]


def prepare(cfg: DataConfig, workdir: str | Path, *, num_bleu_sentences: int = 0,
            is_first_host: bool = True, wait_for_first_host=lambda: None,
            tokenizer_from=None) -> Prepared:
  """Prepares the dataset, tokenizer and token caches; returns them opened. `tokenizer_from`:
  what a fine-tuning run starts from, whose tokenizer it takes
  (`tokenizers_for`).

  With several hosts, the first does the work and the others read the result once
  `wait_for_first_host()` returns (workdir and cache on a shared filesystem).
  """
  from transformer_jax.data import sources  # tfds loads here, not on import.
  workdir = Path(workdir)  # Created when the tokenizer is saved in it.

  def load(build: bool):
    builder = sources.prepare_config(cfg)
    texts = {split: sources.TextPairs(builder, cfg.dataset, split)
             for split in (cfg.train_split, cfg.eval_split)}
    tokenizers = (tokenizers_for(cfg, texts[cfg.train_split], workdir, tokenizer_from) if build
                  else Tokenizers.load(workdir))
    fp = token_cache.fingerprint(_tokenizer_files(workdir))
    caches = {}
    for split, text in texts.items():
      directory = cache_root(cfg) / fp / _split_dir(split)
      caches[split] = (token_cache.build(directory, text, tokenizers, fp,
                                         resolve_workers(cfg.num_workers))
                       if build else token_cache.TokenCache(directory))
    return tokenizers, caches, texts[cfg.eval_split]

  if is_first_host:
    tokenizers, caches, eval_text = load(build=True)
  wait_for_first_host()
  if not is_first_host:
    tokenizers, caches, eval_text = load(build=False)
  bleu_pairs = []
  if num_bleu_sentences > 0:  # A fixed sample spread over the eval split.
    stride = max(1, len(eval_text) // num_bleu_sentences)
    bleu_pairs = sources.pairs_of(eval_text, range(0, len(eval_text), stride)[
        :num_bleu_sentences])
  return Prepared(tokenizers, caches[cfg.train_split], caches[cfg.eval_split], bleu_pairs)


def prepare_documents(cfg: DataConfig, workdir: str | Path, *, is_first_host: bool = True,
                      wait_for_first_host=lambda: None,
                      tokenizer_from=None) -> Prepared:
  """`prepare` for a corpus of documents: the dataset, a lossless SentencePiece fitted
  on the training documents' lines, and a token cache of each split (one record a document)."""
  from transformer_jax.data import sources  # tfds loads here, not on import.
  workdir = Path(workdir)

  def load(build: bool):
    builder = sources.prepare_config(cfg)
    texts = {split: sources.TextPairs(builder, cfg.dataset, split)
             for split in (cfg.train_split, cfg.eval_split)}
    tokenizers = (tokenizers_for(cfg, texts[cfg.train_split], workdir, tokenizer_from,
                                          fit=documents.fit_tokenizer) if build
                  else Tokenizers.load(workdir))
    fp = token_cache.fingerprint(_tokenizer_files(workdir))
    caches = {}
    for split, text in texts.items():
      directory = cache_root(cfg) / fp / _split_dir(split)
      caches[split] = (token_cache.build(directory, text, (tokenizers.tgt,), fp,
                                         resolve_workers(cfg.num_workers),
                                         sides=token_cache.DOCUMENT_SIDES)
                       if build else token_cache.TokenCache(directory))
    return tokenizers, caches

  if is_first_host:
    tokenizers, caches = load(build=True)
  wait_for_first_host()
  if not is_first_host:
    tokenizers, caches = load(build=False)
  return Prepared(tokenizers, caches[cfg.train_split], caches[cfg.eval_split], [])


class LabelsError(UserError, ValueError):
  """Labels a classifier cannot train on: a held-out label no training text has, or a resumed
  run's training split holding other labels than it started with."""


def prepare_labelled(cfg: DataConfig, workdir: str | Path, *, is_first_host: bool = True,
                     wait_for_first_host=lambda: None, tokenizer_from=None,
                     trained_labels: tuple[str, ...] = ()) -> Prepared:
  """`prepare_documents` for labelled texts (a classifier's corpus): each text one record of
  the token caches, and its label's id among the training split's labels, sorted by name (the
  order of the classifier's outputs). `trained_labels`: those a resumed run was trained on,
  which the training split must still hold."""
  from transformer_jax.data import sources  # tfds loads here, not on import.
  data = prepare_documents(cfg, workdir, is_first_host=is_first_host,
                           wait_for_first_host=wait_for_first_host, tokenizer_from=tokenizer_from)
  builder = sources.prepare_config(cfg)
  labels = {}
  for split in (cfg.train_split, cfg.eval_split):
    text = sources.TextPairs(builder, cfg.dataset, split)
    labels[split] = [label for start in range(0, len(text), 10_000)
                     for label in text.read(range(start, min(start + 10_000, len(text))))[1]]
  names = tuple(sorted(set(labels[cfg.train_split])))
  if trained_labels and trained_labels != names:
    raise LabelsError(
        f"{workdir} was trained on the labels {', '.join(trained_labels)}; its training split "
        f"{cfg.train_split!r} now holds {', '.join(names)}: train in another workdir")
  unseen = sorted(set(labels[cfg.eval_split]) - set(names))
  if unseen:
    raise LabelsError(f"split {cfg.eval_split!r} of {cfg.dataset} has the label "
                      f"{unseen[0]!r}, which no text of {cfg.train_split!r} has")
  index = {name: i for i, name in enumerate(names)}
  ids = {split: np.array([index[x] for x in values], np.int32) for split, values in labels.items()}
  return dataclasses.replace(data, label_names=names, train_labels=ids[cfg.train_split],
                             eval_labels=ids[cfg.eval_split])


def log_selection(split: str, sel: packing.Selection, max_len: int) -> None:
  logging.info("%s: %d of %d pairs kept; %d dropped (empty or over %d tokens), %d truncated",
               split, len(sel.ids), sel.total, sel.dropped, max_len, sel.truncated)


class TrainStream:
  """Endless training batches (this host's rows of each global batch) from a block planner.

  `blocks` plans and fills each global block of batches (`packing.TrainBlocks` of pairs,
  `documents.DocumentBlocks` of documents' chunks, `labelled.LabelledBlocks` of labelled texts:
  `pair_stream`, `document_stream` and `labelled_stream` make each), in `num_workers` grain
  worker processes (0: a thread of this process), and hands them out batch by batch here,
  `features` of each. The position `get_state()` is {"block", "batch"}: the next batch is batch
  `batch` of global block `block`. It is host- and worker-independent, so any run can resume it.
  """

  def __init__(self, blocks, features: tuple[str, ...], num_workers: int = 0):
    self.blocks, self.features = blocks, features
    self.num_workers = num_workers
    self._block, self._batch = 0, 0
    self._current: dict[str, np.ndarray] | None = None
    self._iter = None

  @property
  def selection(self) -> packing.Selection:
    return self.blocks.selection

  def get_state(self) -> dict[str, int]:
    return {"block": self._block, "batch": self._batch}

  def set_state(self, state: dict[str, int]) -> None:
    self.close()
    self._block, self._batch = int(state["block"]), int(state["batch"])

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    while self._current is None or self._batch >= len(self._current["targets"]):
      if self._current is not None:
        self._block, self._batch = self._block + 1, 0
      if self._iter is None:
        self._iter = workers.OrderedMap(self._block, 2 ** 62, self.blocks, self.num_workers)
      self._current = next(self._iter)
      assert int(self._current["block"]) == self._block, "blocks arrived out of order"
    batch = {k: self._current[k][self._batch] for k in self.features}
    self._batch += 1
    return batch

  def close(self) -> None:
    if self._iter is not None:
      self._iter.close()
    self._iter, self._current = None, None


def eval_batches(cache: token_cache.TokenCache, *, batch_size: int, max_len: int, overlong: str,
                 pack: bool = True, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """[batch_size // process_count, max_len] batches holding every kept pair once.

  Pairs are packed first-fit in split order as in training (`pack`), or one a row. Every host
  computes the same plan of global batches and fills its own rows of each: so every host gets
  the same number of batches, the rows a host lacks are empty (segment id 0 everywhere),
  shapes never change and collectives line up.
  """
  sel = packing.select(cache, max_len, overlong)
  packing.require_pairs(sel, max_len, "the evaluation split")
  plans = (packing.first_fit(sel.src_len + 1, sel.tgt_len + 1, batch_size, max_len) if pack
           else packing.one_per_row(len(sel.ids), batch_size))
  local = batch_size // process_count
  first, stop = process_index * local, (process_index + 1) * local
  tokens = (cache.tokens("src"), cache.tokens("tgt"))
  offsets = (cache.offsets("src"), cache.offsets("tgt"))
  batches = []
  for plan in plans:
    mine = (plan.row >= first) & (plan.row < stop)
    ex = plan.example[mine]
    pair = sel.ids[ex]
    batches.append(packing.fill_rows(
        tokens, (packing.token_index(offsets[0][pair], sel.src_len[ex]),
                 packing.token_index(offsets[1][pair], sel.tgt_len[ex])),
        (sel.src_len[ex], sel.tgt_len[ex]), plan.row[mine] - first,
        (plan.src_offset[mine], plan.tgt_offset[mine]), local, max_len))
  return batches


def rows(batch_size: int, max_len: int, seed: int, pack: bool = True, process_index: int = 0,
         process_count: int = 1) -> dict:
  """A block planner's arguments for this host's rows of each global batch."""
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} is not divisible by {process_count} processes")
  local = batch_size // process_count
  return dict(rows=batch_size, row_start=process_index * local,
              row_stop=(process_index + 1) * local, max_len=max_len, seed=seed, packing=pack)


def pair_stream(cache: token_cache.TokenCache, *, overlong: str, concat_prob: float = 0.0,
                concat_max: int = 1, num_workers: int = 0, **row_args) -> TrainStream:
  """Packed sentence pairs (`row_args`: those of `rows`)."""
  return TrainStream(packing.TrainBlocks(cache, overlong=overlong, concat_prob=concat_prob,
                                         concat_max=concat_max, **rows(**row_args)),
                     FEATURES, num_workers)


def document_stream(cache: token_cache.TokenCache, *, num_workers: int = 0,
                    **row_args) -> TrainStream:
  """Chunks of documents, max_len tokens each, packed."""
  return TrainStream(DocumentBlocks(cache, **rows(**row_args)), packing.LM_FEATURES,
                     num_workers)


def labelled_stream(cache: token_cache.TokenCache, labels: np.ndarray, *, fraction: float = 1.0,
                    num_workers: int = 0, **row_args) -> TrainStream:
  """Labelled texts, one a row (`fraction` of them: labelled.subset); `labels`: their ids."""
  return TrainStream(labelled.LabelledBlocks(cache, labels, fraction=fraction,
                                             **rows(**row_args)),
                     labelled.FEATURES, num_workers)


class Prefetched:
  """Keeps the next batch already put on the devices while the current step runs.

  `put` turns a host batch into device arrays (the transfer is asynchronous). `state` is the
  stream position after the batch last returned: the point to resume from.
  """

  def __init__(self, stream: TrainStream, put):
    self._stream, self._put = stream, put
    self.state = stream.get_state()
    self._next = self._pull()

  def _pull(self):
    batch = self._put(next(self._stream))
    return batch, self._stream.get_state()

  def __iter__(self):
    return self

  def __next__(self):
    batch, self.state = self._next
    self._next = self._pull()
    return batch
