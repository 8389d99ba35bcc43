"""Model-agnostic autoregressive decoding: greedy, sampling and beam search.

Everything here takes a `tokens_to_logits(tokens [B, 1], cache) -> (logits [B, V], cache)`
callable and runs inside one `lax.while_loop` that stops once every row (in beam search, every
sentence) is done, so a jitted decoder compiles once per (batch size, max length). The cache is
any pytree whose arrays lead with the batch axis; 0-d leaves (a step counter) are shared by all
rows. State that is the same at every step for all of a sentence's beams (its encoding) belongs
in the callable's closure, not in the cache: it is then neither carried nor reordered.

Shapes: B batch, K beams, L max decode length, V vocabulary.

The steps of a search (`sample_step`, `beam_step`, `final_beams`) work with one step counter
for all rows or one for each: the batch decoders here run a batch to its end; slots.py runs
slots that sources enter and leave at their own steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax.config import BEAM_STOPS  # When a beam search ends.


TokensToLogits = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Shortlisted:
  """What a step over a vocabulary shortlist gives instead of [R, V] logits: the logits of the
  shortlist's C columns only [R, C] (columns past it at NEG_INF) and the vocabulary id of each
  column, ascending [C]. The searches pick among columns and emit their ids."""
  logits: jax.Array
  ids: jax.Array


def columns(logits) -> tuple[jax.Array, jax.Array | None]:
  """A step's logits -> (logits [R, C], each column's id [C], or None: column c is id c)."""
  if isinstance(logits, Shortlisted):
    return logits.logits, logits.ids
  return logits, None


def token_ids(picked: jax.Array, ids: jax.Array | None) -> jax.Array:
  """Columns picked -> the vocabulary ids they stand for (`columns`' ids)."""
  return picked if ids is None else jnp.take(ids, picked, axis=0)
NEG_INF = -1e9


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Always the most likely token (the first of equals, as argmax)."""

  def __call__(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
    return top_k(logits, 1)[1][..., 0]  # On a CPU, much faster than jnp.argmax's reduction.


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Sampling at `temperature`, from the `top_k` most likely tokens (0: all) whose cumulative
  probability reaches `top_p` (1.0: all)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not 0 < self.temperature < float("inf"):  # NaN too: it would sample nothing.
      raise ValueError(f"temperature must be a positive number, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  def __call__(self, logits: jax.Array, keys: jax.Array) -> jax.Array:
    """logits [B, V], keys [B] (one random key a row) -> tokens [B]."""
    logits = logits.astype(jnp.float32) / self.temperature  # [B, V]
    if self.top_k:
      kth = lax.top_k(logits, self.top_k)[0][:, -1:]  # [B, 1]
      logits = jnp.where(logits < kth, NEG_INF, logits)
    if self.top_p < 1.0:
      sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V], descending
      probs = jax.nn.softmax(sorted_logits, axis=-1)
      # Keep a token if the tokens more likely than it hold less than top_p; the most likely
      # always (a top_p below float32's normal range flushes to 0 on a CPU).
      first = jnp.arange(probs.shape[-1]) == 0
      keep = (jnp.cumsum(probs, axis=-1) - probs < self.top_p) | first
      threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
      logits = jnp.where(logits < threshold, NEG_INF, logits)
    return jax.vmap(jax.random.categorical)(keys, logits)


def row_keys(rng: jax.Array, items: jax.Array, steps: jax.Array) -> jax.Array:
  """The random key of each row's step: rng folded with the row's item (its sentence's number
  in the input) and step, so a sentence draws the same tokens in any batch or slot."""
  fold = lambda item, step: jax.random.fold_in(jax.random.fold_in(rng, item), step)
  return jax.vmap(fold)(items, jnp.broadcast_to(steps, items.shape))


@dataclasses.dataclass(frozen=True)
class Specials:
  """The ids decoding treats specially: the first input, the end of a sentence, padding."""
  bos: int
  eos: int
  pad: int


def sample(tokens_to_logits: TokensToLogits, cache, batch_size: int, max_len: int,
           specials: Specials, sampler=Greedy(), rng: jax.Array | None = None) -> jax.Array:
  """Generates [B, max_len] tokens; after <eos> a row emits <pad>. The loop stops once every
  row has ended (or at max_len)."""
  return sample_scored(tokens_to_logits, cache, batch_size, max_len, specials, sampler, rng)[0]


def sample_scored(tokens_to_logits: TokensToLogits, cache, batch_size: int, max_len: int,
                  specials: Specials, sampler=Greedy(), rng: jax.Array | None = None,
                  limits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """`sample`, with each row's log-probability under the model: (tokens [B, max_len],
  log-probabilities [B], the sum over the tokens up to and with <eos>). `limits` [B] (at most
  max_len): each row's own length limit; a row stops there as it would at max_len. Row i
  samples with the keys `row_keys(rng, i, step)`."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  limits = jnp.full((batch_size,), max_len) if limits is None else limits
  items = jnp.arange(batch_size)

  def cond(state):
    t, _, _, done, _, _ = state
    return (t < max_len) & ~jnp.all(done | (t >= limits))

  def body(state):
    t, cache, last, done, out, logprob = state
    done = done | (t >= limits)
    cache, token, done, logprob = sample_step(tokens_to_logits, cache, last, done, logprob,
                                              specials, sampler, row_keys(rng, items, t))
    out = lax.dynamic_update_slice(out, token[:, None], (0, t))  # [B, L]
    return t + 1, cache, token, done, out, logprob

  state = (jnp.array(0), cache, jnp.full((batch_size,), specials.bos, jnp.int32),
           jnp.zeros((batch_size,), bool), jnp.full((batch_size, max_len), specials.pad, jnp.int32),
           jnp.zeros((batch_size,), jnp.float32))
  _, _, _, _, tokens, logprob = lax.while_loop(cond, body, state)
  return tokens, logprob


def sample_step(tokens_to_logits: TokensToLogits, cache, last, done, logprob,
                specials: Specials, sampler, keys, scores: bool = True):
  """One step of greedy decoding or sampling for rows whose last tokens are `last` [B]: (cache,
  tokens [B], done [B], log-probabilities [B]). A row already `done` emits <pad> and keeps its
  log-probability; a row that emits <eos> is done. Without `scores` the log-probabilities are
  left as they are: no log-softmax over the vocabulary (on a 2-core CPU, 1.3-1.4 ms of a step
  of about 20 ms at 128 rows and 8,000 tokens: docs/translating.md)."""
  logits, cache = tokens_to_logits(last[:, None], cache)  # [B, V]
  logits, ids = columns(logits)
  token = sampler(logits, keys).astype(jnp.int32)
  if scores:
    # The chosen token's log-probability, without writing the [B, V] log-softmax.
    logits = logits.astype(jnp.float32)
    logp = (jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
            - jax.nn.logsumexp(logits, axis=-1))  # [B]
    logprob = logprob + jnp.where(done, 0.0, logp)
  token = jnp.where(done, specials.pad, token_ids(token, ids))
  return cache, token, done | (token == specials.eos), logprob


def top_k(x: jax.Array, k: int, block: int = 32) -> tuple[jax.Array, jax.Array]:
  """lax.top_k over the last axis (values, indices), reading it once: the k best values lie in
  the k blocks of `block` values with the best maxima, so only those k * block candidates are
  ranked. On a CPU, for a vocabulary-sized axis and a small k, several times faster than
  lax.top_k (and than jnp.argmax for k = 1)."""
  lead, v = x.shape[:-1], x.shape[-1]
  x = x.reshape(-1, v)  # 2-D: XLA's CPU TopK kernel (on more dimensions, it may sort).
  if v < 4 * k * block:
    values, indices = lax.top_k(x, k)
  else:
    x = jnp.pad(x, [(0, 0), (0, -v % block)], constant_values=-jnp.inf)
    blocks = x.reshape(x.shape[0], -1, block)  # [R, V / block, block]
    _, best = lax.top_k(jnp.max(blocks, axis=-1), k)  # [R, k]
    best = jnp.sort(best, axis=-1)  # Candidates in index order: ties go to the lower index.
    cand = jnp.take_along_axis(blocks, best[:, :, None], axis=1).reshape(x.shape[0], -1)
    values, pick = lax.top_k(cand, k)
    indices = jnp.take_along_axis(best, pick // block, axis=-1) * block + pick % block
  return values.reshape(*lead, k), indices.reshape(*lead, k)


def length_penalty(length, alpha: float):
  """GNMT's ((5 + length) / 6) ** alpha."""
  return ((5.0 + length) / 6.0) ** alpha


def _stay_in_place(parents: jax.Array) -> jax.Array:
  """parents [B, K]: the beam each of K new beams continues. -> place [B, K]: the new beams'
  order in which beam j continues beam j whenever beam j has a continuation (its first one),
  the other new beams taking, in their order, the places of the beams that have none."""
  k = parents.shape[1]
  is_child = parents[:, :, None] == jnp.arange(k)[None, None, :]  # [B, new, old]
  first = is_child & (jnp.cumsum(is_child, axis=1) == 1)  # The first continuation of each old.
  kept = first.any(axis=1)  # [B, old]: places held by their own first continuation.
  rest = ~first.any(axis=2)  # [B, new]: new beams that go to a free place.
  # The r-th of the rest takes the r-th free place.
  rank_rest = jnp.where(rest, jnp.cumsum(rest, axis=1) - 1, -1)  # [B, new]
  rank_free = jnp.where(~kept, jnp.cumsum(~kept, axis=1) - 1, -2)  # [B, old]
  to_free = rank_rest[:, :, None] == rank_free[:, None, :]  # [B, new, old]
  placed = first | to_free  # Exactly one True per new beam and per place.
  return jnp.argmax(placed, axis=1).astype(jnp.int32)  # [B, place]: the new beam there.


# The part of a cache row that a moved beam copies, as fractions of the row's positions: the
# first quarter, half or all of them, the smallest that holds the positions written so far.
COPY_FRACTIONS = (4, 2, 1)


def _copy_parents(tree, parents: jax.Array, written: jax.Array | None = None,
                  positions_axis: int | None = None, copy: str = "loop"):
  """Each [B * K, ...] leaf's row b * K + j becomes a copy of row b * K + parents[b, j], in
  place and only where they differ. Safe with `_stay_in_place`'s order: a row copied from is
  a beam that continues in its own place, so no copy overwrites a row still to be read.

  `positions_axis` (the cache's axis of positions, in leaves of 3 or more axes) and `written`
  (a scalar: how many positions any row has written), given, copy only the first quarter, half
  or all of that axis that holds the written ones (COPY_FRACTIONS): a row reads no position it
  did not write, and a search's first steps then move a quarter of the bytes.

  `copy` "gather" (platforms.py says which a platform uses) takes every row of every leaf from
  its parent in one gather instead, `written` and `positions_axis` aside."""
  if copy not in ("loop", "gather"):
    raise ValueError(f"row copy {copy!r} is not 'loop' or 'gather'")
  b, k = parents.shape
  dst = jnp.arange(b * k)
  src = (jnp.arange(b)[:, None] * k + parents).reshape(-1)
  if copy == "gather":
    return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, src, axis=0), tree)
  moved = src != dst
  order = jnp.argsort(~moved, stable=True)  # The rows to copy first.

  def copier(fraction: int):
    def part(x):  # The copied block's shape: one row, the positions cut to the fraction.
      shape = [1, *x.shape[1:]]
      if positions_axis is not None and x.ndim >= 3:
        axis = positions_axis % x.ndim
        shape[axis] = -(-x.shape[axis] // fraction)
      return shape

    def copy(i, tree):
      row, zeros = order[i], lambda x: (0,) * (x.ndim - 1)
      return jax.tree.map(lambda x: x if x.ndim == 0 else lax.dynamic_update_slice(
          x, lax.dynamic_slice(x, (src[row], *zeros(x)), part(x)), (row, *zeros(x))), tree)
    return copy

  count = jnp.sum(moved)
  lengths = [] if positions_axis is None else [
      x.shape[positions_axis] for x in jax.tree.leaves(tree) if x.ndim >= 3]
  if written is None or not lengths:
    return lax.fori_loop(0, count, copier(1), tree)
  taken = jnp.zeros((), bool)
  for fraction in COPY_FRACTIONS:  # Exactly one of these loops runs (the others 0 times).
    fits = (written <= -(-min(lengths) // fraction)) | (fraction == 1)
    tree = lax.fori_loop(0, jnp.where(fits & ~taken, count, 0), copier(fraction), tree)
    taken = taken | fits
  return tree


def tile_beams(tree, beams: int):
  """[B, ...] -> [B * K, ...], each row repeated K times (0-d leaves untouched)."""
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.repeat(x, beams, axis=0), tree)


def beam_search(tokens_to_logits: TokensToLogits, cache, batch_size: int, max_len: int,
                specials: Specials, beam_size: int = 4, alpha: float = 0.6,
                limits: jax.Array | None = None, stop: str = "exact",
                positions_axis: int | None = None,
                copy: str = "loop") -> tuple[jax.Array, jax.Array]:
  """Beam search with GNMT's length penalty; `cache` is per sentence ([B, ...] leaves).

  A sentence's search ends by the rule `stop` (BEAM_STOPS). `limits` [B] (at most max_len):
  each sentence's own length limit; its search stops there (its state is kept from then on)
  and ends as it would at max_len. `positions_axis`: the cache's axis of positions, if it has
  one (beam_step). `copy`: how moved beams' cache rows are copied (platforms.py says which a
  platform uses).
  Returns:
    tokens [B, K, max_len] best first (<eos> then <pad> after the end), scores [B, K].
  """
  b, k = batch_size, beam_size
  max_penalty = length_penalty(max_len if limits is None else limits, alpha)  # [] or [B]

  def cond(state):
    i = state[0]
    done = beam_done(state, max_penalty, stop)
    if limits is not None:
      done = done | (i >= limits)
    return (i < max_len) & ~jnp.all(done)

  def body(state):
    new = beam_step(tokens_to_logits, state, specials, alpha, k, stop,
                    positions_axis=positions_axis, copy=copy)
    if limits is None:
      return new
    # A sentence at its limit keeps its state (the cache's rows need not: nothing reads them).
    return keep_beams(state[0] >= limits, state, new)

  state = (jnp.array(0), *initial_beams(b, k, max_len, specials), tile_beams(cache, k))
  _, *beams, _ = lax.while_loop(cond, body, state)
  return final_beams(*beams, max_penalty, specials)


def initial_beams(b: int, k: int, max_len: int, specials: Specials):
  """(live_seqs, live_logp, fin_seqs, fin_scores, fin_flags) of B searches before their first
  step: every beam <bos>, the first one live."""
  seqs = jnp.zeros((b, k, max_len + 1), jnp.int32).at[:, :, 0].set(specials.bos)
  live_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1))
  return seqs, live_logp, seqs, jnp.full((b, k), NEG_INF, jnp.float32), jnp.zeros((b, k), bool)


def beam_done(state, max_penalty, stop: str = "exact") -> jax.Array:
  """[B]: the searches that end by the rule `stop`. "exact": K beams finished and no live beam
  can beat them any more: its log-prob now, at the largest length penalty (log-probs only
  fall, and the penalty grows with length for alpha >= 0). "first_k": K beams finished."""
  _, _, live_logp, _, fin_scores, fin_flags, _ = state
  if stop == "first_k":
    return fin_flags.all(-1)
  best_live = live_logp.max(-1) / max_penalty
  worst_fin = jnp.where(fin_flags.all(-1), fin_scores.min(-1), NEG_INF)
  return worst_fin >= best_live


def keep_beams(stopped: jax.Array, old, new):
  """The search state `new`, where the searches `stopped` [B] keep `old`'s (the step counter
  and the cache excepted: the cache's rows of a stopped search are read no more)."""
  keep = lambda o, x: jnp.where(stopped.reshape(-1, *[1] * (x.ndim - 1)), o, x)
  i = new[0] if jnp.ndim(new[0]) == 0 else keep(old[0], new[0])
  return (i, *map(keep, old[1:6], new[1:6]), new[6])


def beam_step(tokens_to_logits: TokensToLogits, state, specials: Specials, alpha, k: int,
              stop: str = "exact", positions_axis: int | None = None,
              written: jax.Array | None = None, copy: str = "loop"):
  """One step of B searches of K beams: state (i, live_seqs [B, K, L+1], live_logp [B, K],
  fin_seqs, fin_scores, fin_flags, cache [B*K rows]) -> the next. `i`: the step, one for all
  searches ([]) or each its own ([B]). A candidate ending in <eos> joins the finished ones
  if it is among the step's 2K best ("exact") or K best ("first_k", as CTranslate2 counts
  the hypotheses that end its search).

  `positions_axis`: the cache's axis of positions (the model's caches: -2), where a step at
  `i` writes position i; given, a beam moved to another row copies only the positions written
  (`written`, default the largest i + 1; `_copy_parents`). `copy`: how moved beams' cache
  rows are copied (decoding/platforms.py says which a platform uses)."""
  if stop not in BEAM_STOPS:
    raise ValueError(f"beam stop {stop!r} is not one of {BEAM_STOPS}")
  i, live_seqs, live_logp, fin_seqs, fin_scores, fin_flags, cache = state
  b = live_seqs.shape[0]
  if jnp.ndim(i) == 0:
    last = live_seqs[:, :, i]
  else:
    last = jnp.take_along_axis(live_seqs, i[:, None, None], axis=2)[:, :, 0]
  logits, cache = tokens_to_logits(last.reshape(b * k, 1), cache)  # [B*K, V]
  logits, ids = columns(logits)
  logits = logits.astype(jnp.float32).reshape(b, k, -1)  # [B, K, V]
  vocab = logits.shape[-1]
  # The 2K best continuations of the sentence are among the 2K best of each beam: pick
  # those from the logits (a row's log-softmax keeps its order), then take their
  # log-probabilities (log_softmax's own arithmetic: x - max - log(sum(exp(x - max))))
  # without writing the [B, K, V] log-probabilities.
  per_row = min(2 * k, vocab)
  row_top, row_idx = top_k(logits, per_row)  # [B, K, 2K]
  top = row_top[:, :, :1]  # [B, K, 1]: each row's largest logit
  log_sum = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
  cand = (live_logp[:, :, None] + ((row_top - top) - log_sum)).reshape(b, k * per_row)
  top_logp, pick = lax.top_k(cand, 2 * k)  # [B, 2K]: enough to keep K that go on.
  beam = pick // per_row
  token = jnp.take_along_axis(row_idx.reshape(b, -1), pick, axis=1).astype(jnp.int32)
  token = token_ids(token, ids)
  seqs = jnp.take_along_axis(live_seqs, beam[:, :, None], axis=1)  # [B, 2K, L+1]
  if jnp.ndim(i) == 0:
    seqs = lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, i + 1))
    penalty = length_penalty(i + 1, alpha)
  else:
    at = jnp.arange(seqs.shape[2])[None, None, :] == (i + 1)[:, None, None]
    seqs = jnp.where(at, token[:, :, None], seqs)
    penalty = length_penalty(i + 1, alpha)[:, None]
  is_eos = token == specials.eos
  ends = is_eos if stop == "exact" else is_eos & (jnp.arange(2 * k) < k)

  # Live: the K best candidates that did not just end, each placed where its parent was if it
  # is that parent's first (so most cache rows stay where they are: only the rest are copied).
  alive_logp = jnp.where(is_eos, NEG_INF, top_logp)
  alive_logp, keep = lax.top_k(alive_logp, k)  # [B, K]
  place = _stay_in_place(jnp.take_along_axis(beam, keep, axis=1))  # [B, K]
  keep = jnp.take_along_axis(keep, place, axis=1)
  alive_logp = jnp.take_along_axis(alive_logp, place, axis=1)
  live_seqs = jnp.take_along_axis(seqs, keep[:, :, None], axis=1)
  written = jnp.max(i) + 1 if written is None else written
  cache = _copy_parents(cache, jnp.take_along_axis(beam, keep, axis=1), written, positions_axis,
                        copy)

  # Finished: the K best of the old finished and the candidates that just ended.
  new_scores = jnp.where(ends, top_logp / penalty, NEG_INF)
  all_scores = jnp.concatenate([fin_scores, new_scores], axis=1)  # [B, 3K]
  all_seqs = jnp.concatenate([fin_seqs, seqs], axis=1)
  all_flags = jnp.concatenate([fin_flags, ends], axis=1)
  fin_scores, pick = lax.top_k(all_scores, k)
  fin_seqs = jnp.take_along_axis(all_seqs, pick[:, :, None], axis=1)
  fin_flags = jnp.take_along_axis(all_flags, pick, axis=1)
  return i + 1, live_seqs, alive_logp, fin_seqs, fin_scores, fin_flags, cache


def final_beams(live_seqs, live_logp, fin_seqs, fin_scores, fin_flags, max_penalty,
                specials: Specials) -> tuple[jax.Array, jax.Array]:
  """(tokens [B, K, L], scores [B, K]) of B searches, best first. The slots of a sentence that
  finished fewer than K beams (finished ones come first, best first) take its live beams, best
  first, scored at the largest length penalty `max_penalty` ([] or [B])."""
  k = live_seqs.shape[1]
  live_logp, by_score = lax.top_k(live_logp, k)  # Live beams best first.
  live_seqs = jnp.take_along_axis(live_seqs, by_score[:, :, None], axis=1)
  slot = jnp.arange(k)[None, :] - fin_flags.sum(-1, keepdims=True)  # [B, K]: live beam to take
  live_pick = jnp.clip(slot, 0, k - 1)
  live_seqs = jnp.take_along_axis(live_seqs, live_pick[:, :, None], axis=1)
  live_scores = jnp.take_along_axis(live_logp, live_pick, axis=1) / jnp.reshape(max_penalty,
                                                                                (-1, 1))
  tokens = jnp.where(fin_flags[:, :, None], fin_seqs, live_seqs)[:, :, 1:]
  scores = jnp.where(fin_flags, fin_scores, live_scores)
  return _pad_after_eos(tokens, specials), scores


def _pad_after_eos(tokens: jax.Array, specials: Specials) -> jax.Array:
  """Everything after the first <eos> becomes <pad>."""
  eos = tokens == specials.eos
  after = jnp.cumsum(eos, axis=-1) - eos > 0
  return jnp.where(after, specials.pad, tokens)


def strip(tokens: np.ndarray, specials: Specials) -> list[int]:
  """A row of output tokens up to (not including) <eos>."""
  out = []
  for t in np.asarray(tokens).tolist():
    if t in (specials.eos, specials.pad):
      break
    out.append(t)
  return out


def tokens_only(logits, vocab: int | None):
  """Logits [..., V] cut to the tokenizer's `vocab` ids (None: all): the model's vocabulary is
  padded (build.padded_vocab), and its extra ids are no tokens."""
  return logits if vocab is None else logits[..., :vocab]
