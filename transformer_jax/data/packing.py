"""Packing sentence pairs into fixed [rows, max_len] batches. NumPy only: runs in grain workers.

Two steps. `first_fit` plans a global batch from lengths alone (which row, at which offset, each
pair goes), so every host computes the same plan without reading a token. `fill_rows` then
gathers the tokens of the rows one host owns from flat token arrays into the batch features:

  inputs          source + <eos>            inputs_segment_ids, inputs_positions
  decoder_inputs  <bos> + target            (share the targets' segments and positions)
  targets         target + <eos>            targets_segment_ids, targets_positions

Segment ids number the examples of a row from 1 (0 = padding); positions restart at 0 in each.
An example is one pair, or, with concatenation augmentation (`concat_groups`), several
consecutive pairs joined into one longer pair (sources joined, targets joined).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from transformer_jax.errors import UserError
from transformer_jax.data.tokenizer import BOS, EOS

FEATURES = ("inputs", "inputs_segment_ids", "inputs_positions", "decoder_inputs", "targets",
            "targets_segment_ids", "targets_positions")
# A language model's batch: the target side alone (decoder_inputs[t] predicts targets[t]).
LM_FEATURES = FEATURES[3:]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where the pairs of one batch go; all fields [n], in placement order."""
  example: np.ndarray  # Index into the lengths that were planned.
  row: np.ndarray
  src_offset: np.ndarray
  tgt_offset: np.ndarray


def first_fit(src_len: np.ndarray, tgt_len: np.ndarray, rows: int, max_len: int,
              max_misses: int = 32) -> list[Plan]:
  """Packs pairs, in order, into batches of `rows` rows of `max_len` tokens a side.

  Each pair goes into the first row with room for both its sides. A pair that fits nowhere
  waits for the next batch (which takes the waiting pairs first); a batch is closed after
  `max_misses` such pairs, or when the pairs run out. Every pair is placed exactly once.

  Args:
    src_len, tgt_len: [n] lengths with <eos>, each in [1, max_len].
  """
  src, tgt = np.asarray(src_len).tolist(), np.asarray(tgt_len).tolist()
  if src and (max(src) > max_len or max(tgt) > max_len or min(src) < 1 or min(tgt) < 1):
    raise ValueError(f"pair lengths must lie in [1, {max_len}]")
  plans, waiting, nxt, n = [], [], 0, len(src)
  while nxt < n or waiting:
    free_s, free_t = [max_len] * rows, [max_len] * rows
    placed: list[tuple[int, int, int, int]] = []
    still_waiting: list[int] = []

    def place(i: int) -> bool:
      s, t = src[i], tgt[i]
      for r in range(rows):
        if free_s[r] >= s and free_t[r] >= t:
          placed.append((i, r, max_len - free_s[r], max_len - free_t[r]))
          free_s[r] -= s
          free_t[r] -= t
          return True
      return False

    for i in waiting:
      if not place(i):
        still_waiting.append(i)
    misses = 0
    while nxt < n and misses < max_misses:
      if not place(nxt):
        still_waiting.append(nxt)
        misses += 1
      nxt += 1
    waiting = still_waiting
    plans.append(Plan(*(np.array(c, np.int64) for c in zip(*placed))))
  return plans


def _spans(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """For spans of `lengths` laid end to end: each element's span and its index within it."""
  owner = np.repeat(np.arange(len(lengths)), lengths)
  within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  return owner, within


def _segments(row: np.ndarray) -> np.ndarray:
  """1 + the number of earlier pairs in the same row (pairs are in placement order)."""
  order = np.argsort(row, kind="stable")
  sorted_rows = row[order]
  first = np.searchsorted(sorted_rows, sorted_rows, side="left")
  seg = np.empty_like(row)
  seg[order] = np.arange(len(row)) - first + 1
  return seg


def token_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Indices into a flat token array of spans (`starts`, `lengths`) laid end to end: the
  tokens of one example, or of the pairs joined into one, are consecutive here."""
  owner, within = _spans(np.asarray(lengths, np.int64))
  return np.asarray(starts, np.int64)[owner] + within


def fill_rows(tokens: tuple[np.ndarray, np.ndarray], index: tuple[np.ndarray, np.ndarray],
              lengths: tuple[np.ndarray, np.ndarray], row: np.ndarray,
              offsets: tuple[np.ndarray, np.ndarray], rows: int,
              max_len: int) -> dict[str, np.ndarray]:
  """The batch features of `rows` rows from flat (source, target) token arrays.

  Args:
    tokens: flat token ids of each side (arrays or memmaps), without <eos>.
    index: per side, where the tokens of the examples are in `tokens`, the examples laid end
      to end (`token_index`); example i takes the next lengths[side][i] of them.
    lengths: [n] tokens per example (at least 1, at most max_len - 1), per side.
    row, offsets: [n] the row of each example and its start in the row, per side, as planned.
  Returns:
    FEATURES -> [rows, max_len] int32.
  """
  out = {k: np.zeros((rows, max_len), np.int32) for k in FEATURES}
  seg = _segments(row)
  for side, name in enumerate(("inputs", "targets")):
    n = np.asarray(lengths[side], np.int64)
    owner, j = _spans(n + 1)  # +1: <eos>
    dest = row[owner] * max_len + offsets[side][owner] + j
    first, n_own = (np.cumsum(n) - n)[owner], n[owner]
    ids = np.asarray(tokens[side][index[side][first + np.minimum(j, n_own - 1)]], np.int32)
    out[name].flat[dest] = np.where(j == n_own, EOS, ids)
    out[f"{name}_segment_ids"].flat[dest] = seg[owner]
    out[f"{name}_positions"].flat[dest] = j
    if name == "targets":  # <bos> + target: the target shifted right by one.
      shifted = np.asarray(tokens[side][index[side][first + np.maximum(j - 1, 0)]], np.int32)
      out["decoder_inputs"].flat[dest] = np.where(j == 0, BOS, shifted)
  return out


def concat_groups(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, prob: float,
                  max_pairs: int, rng: np.random.Generator) -> np.ndarray:
  """Joins consecutive pairs into longer training examples (concatenation augmentation).

  Each pair joins the example of the pair before it with probability `prob`, while that
  example has fewer than `max_pairs` pairs and both joined sides, with <eos>, fit in
  `max_len`. Returns [n] the example index of each pair (0, 1, ..., non-decreasing).
  """
  joins = rng.random(len(src_len)) < prob
  group = np.empty(len(src_len), np.int64)
  g, s, t, k = -1, 0, 0, 0
  for i, (a, b) in enumerate(zip(np.asarray(src_len).tolist(), np.asarray(tgt_len).tolist())):
    if g >= 0 and joins[i] and k < max_pairs and s + a < max_len and t + b < max_len:
      s, t, k = s + a, t + b, k + 1
    else:
      g, s, t, k = g + 1, a, b, 1
    group[i] = g
  return group


def one_per_row(n: int, rows: int) -> list[Plan]:
  """Batches of `rows` pairs, one a row at offset 0 (padding instead of packing)."""
  plans = []
  for start in range(0, n, rows):
    k = min(rows, n - start)
    zeros = np.zeros(k, np.int64)
    plans.append(Plan(np.arange(start, start + k), np.arange(k), zeros, zeros))
  return plans


@dataclasses.dataclass(frozen=True)
class Selection:
  """The pairs of a token cache that training uses, and their lengths (without <eos>)."""
  ids: np.ndarray  # [n] pair indices into the cache
  src_len: np.ndarray  # [n] at most max_len - 1 (overlong pairs truncated or dropped)
  tgt_len: np.ndarray
  total: int
  truncated: int
  dropped: int


class NoPairsError(UserError, ValueError):
  """A split keeps no pair to train or evaluate on."""


def require_pairs(sel: Selection, max_len: int, what: str) -> None:
  """Raises NoPairsError naming `what` (e.g. "the training split") where `sel` kept none."""
  if not len(sel.ids):
    raise NoPairsError(
        f"{what} leaves no pair to use: all {sel.total} are empty or over data.max_len={max_len} "
        "tokens a side (with <eos>); raise data.max_len, set data.overlong='truncate' or check "
        "the data")


def select(cache, max_len: int, overlong: str) -> Selection:
  """Drops empty pairs, and drops or truncates pairs over `max_len` tokens with <eos>."""
  if overlong not in ("drop", "truncate"):
    raise ValueError(f"overlong must be 'drop' or 'truncate', got {overlong!r}")
  s, t = cache.lengths("src"), cache.lengths("tgt")
  nonempty = (s > 0) & (t > 0)
  over = nonempty & (np.maximum(s, t) + 1 > max_len)
  keep = nonempty & ~over if overlong == "drop" else nonempty
  ids = np.flatnonzero(keep)
  return Selection(ids, np.minimum(s[ids], max_len - 1), np.minimum(t[ids], max_len - 1),
                   total=len(s), truncated=int(over.sum()) if overlong == "truncate" else 0,
                   dropped=int(len(s) - len(ids)))


class TrainBlocks:
  """Global block g -> this host's rows of every batch packed from that block of pairs.

  Epoch e is a seeded permutation of the selected pairs, cut into blocks of about
  `batches_per_block` batches; block g is block g % blocks_per_epoch of epoch
  g // blocks_per_epoch. The plan of a block depends only on (seed, g) and the lengths, and
  every host computes it whole, then fills only its rows [row_start, row_stop): so the global
  batches are the same for any number of hosts or workers. Picklable and lazy: a grain worker
  reopens the cache and recomputes the selection itself.
  """

  def __init__(self, cache, *, rows: int, row_start: int, row_stop: int, max_len: int,
               overlong: str, seed: int, packing: bool = True, batches_per_block: int = 64,
               concat_prob: float = 0.0, concat_max: int = 1):
    self.cache, self.rows, self.max_len, self.overlong = cache, rows, max_len, overlong
    self.row_start, self.row_stop, self.seed, self.packing = row_start, row_stop, seed, packing
    self.batches_per_block = batches_per_block
    self.concat_prob, self.concat_max = concat_prob, concat_max
    self._selection: Selection | None = None
    self._perm: tuple[int, np.ndarray] | None = None

  def __getstate__(self):
    return {**self.__dict__, "_selection": None, "_perm": None}

  @property
  def selection(self) -> Selection:
    if self._selection is None:
      self._selection = select(self.cache, self.max_len, self.overlong)
      require_pairs(self._selection, self.max_len, "the training split")
    return self._selection

  @property
  def block_size(self) -> int:
    """Pairs per block: about `batches_per_block` full batches."""
    sel = self.selection
    per_pair = float(np.mean(np.maximum(sel.src_len, sel.tgt_len) + 1)) if self.packing \
        else self.max_len
    return max(self.rows, int(self.batches_per_block * self.rows * self.max_len / per_pair))

  def __call__(self, g: int) -> dict[str, np.ndarray]:
    sel, size = self.selection, self.block_size
    epoch, b = divmod(int(g), -(-len(sel.ids) // size))
    if self._perm is None or self._perm[0] != epoch:
      self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(sel.ids)))
    chunk = self._perm[1][b * size:(b + 1) * size]  # Indices into the selection.
    src_len, tgt_len = sel.src_len[chunk], sel.tgt_len[chunk]
    # Examples: runs of consecutive pairs of the chunk (one pair each without concatenation).
    group = (concat_groups(src_len, tgt_len, self.max_len, self.concat_prob, self.concat_max,
                           np.random.default_rng([self.seed, epoch, b, 1]))
             if self.concat_prob > 0 else np.arange(len(chunk)))
    ex_src, ex_tgt = (np.bincount(group, weights=n).astype(np.int64) for n in (src_len, tgt_len))
    ex_pairs = np.bincount(group)
    ex_first = np.cumsum(ex_pairs) - ex_pairs  # The example's first position in the chunk.
    plans = (first_fit(ex_src + 1, ex_tgt + 1, self.rows, self.max_len) if self.packing
             else one_per_row(len(ex_src), self.rows))
    local = self.row_stop - self.row_start
    tokens = (self.cache.tokens("src"), self.cache.tokens("tgt"))
    offsets = (self.cache.offsets("src"), self.cache.offsets("tgt"))
    batches = []
    for plan in plans:
      mine = (plan.row >= self.row_start) & (plan.row < self.row_stop)
      ex = plan.example[mine]
      owner, within = _spans(ex_pairs[ex])
      at = ex_first[ex][owner] + within  # The pairs of these examples, in order.
      pair = sel.ids[chunk[at]]  # Indices into the cache.
      batches.append(fill_rows(
          tokens, (token_index(offsets[0][pair], src_len[at]),
                   token_index(offsets[1][pair], tgt_len[at])),
          (ex_src[ex], ex_tgt[ex]), plan.row[mine] - self.row_start,
          (plan.src_offset[mine], plan.tgt_offset[mine]), local, self.max_len))
    out = {k: np.stack([b[k] for b in batches]) for k in FEATURES}
    out["block"] = np.int64(g)
    return out
