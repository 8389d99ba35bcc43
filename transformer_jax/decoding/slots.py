"""Decoding slots (continuous batching): a fixed number of searches over preallocated caches,
which sentences enter as others end, so that every decoder step computes rows still needed.

A batch decoder (search.py) runs a batch until its longest output ends: the rows that ended
earlier go on computing padding, and a beam search waits for its slowest sentence. Here a
`SlotDecoder` keeps `slots` searches (one row each greedy or sampled, K rows for a beam of K),
each with its own step, output limit and source, and compiled programs that a host loop
drives (`streams.decode_all`):

  encode(params, src [P, w])   the next P sources' encodings, padded to the slots' width (on a
                               CPU a chunk of rows at a time: platforms.py)
  refill(state, ...)           free slots (empty, or their search ended) take new sources
  run(state, min_free, steps)  steps every search until `min_free` slots are free, none runs,
                               or `steps` steps are done
  feed(state, encoded, ...)    a run of every slot in which the slots that free up take the
                               next of `encoded`'s sources before the next step (a batch of
                               `slots` sources a call: no slot waits for the host)
  compact(state, order)        the slots reordered (the active ones first)

Each program is compiled once for the decoder's shape (slots, source width, output length, beam
size), whatever the traffic and the length penalty (each search has its own alpha); `encode`
once per source width it meets, `run` once per active size it meets: a run steps only the first
`rows` slots, the smallest of the sizes `slots`, `slots` / 2, ... (on a CPU down to `slots` /
16) that holds every active search, so a step costs as many rows as are busy, not as many as
were allocated (a server's few clients, a file's last sentences). On an accelerator a step of a
few rows costs about what one of every slot does, so `run` has one size there: each size is one
more program to compile and to load at start-up. New searches take the lowest free slots, and
when the searches still running would fit a smaller size, a `compact` program moves them to the
first slots. A `SlotStream` (streams.py) feeds one decoder: sources are put in as they come (a
file's, or a server's requests') and come out as they finish; several streams of one decoder
(each with its own state) may run in threads of their own at once, sharing its programs
(`decode_all`'s lanes). A sentence's tokens and scores are those the batch decoders give it
(its output limit is its own: the caller's `limits`); sampling draws each sentence's tokens
from keys of its item number and step (search.row_keys), so they do not depend on its
neighbours either.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decoding import platforms, search
from transformer_jax.programs import ProgramStore


@dataclasses.dataclass(frozen=True)
class SlotModel:
  """What the slots need of a model, parameters passed in (never captured as constants).

  step(params, tokens [R, 1], cache, sources, index [R]) -> (logits [R, V], cache): one
    decoder position for R rows, row r at position index[r]; `sources` has one row per
    search (a beam's K rows share their source's).
  init_cache(params, rows, max_len) -> the self-attention cache of `rows` rows (no index).
  encode(params, src [P, w], width) -> the sources' decoding state, padded to `width`.
  """
  step: Callable
  init_cache: Callable
  encode: Callable
  describe: str = ""  # What the functions close over (the model's config), for ProgramStore.
  cache_positions: int | None = None  # The cache's axis of positions, if any (beam_step).


# How much smaller each run size is than the next (run_sizes), by use. A server's runs hold
# what its traffic keeps running, for as long as it lasts: their sizes halve, to stay close to
# it. A file's runs shrink only in a width class's tail, its last few sources, and every size
# is a program more to load and a first call more: there they quarter (greedy, 128, 32 and 8
# rows instead of 128, 64, 32, 16 and 8). On 2 cores of an AMD EPYC that made later commands on
# the Tatoeba file faster, beam 4 in 3 pairs of 3, greedy in 6 of 8, and eighths gained nothing
# more.
RUN_RATIO = {"file": 4, "server": 2}


def run_sizes(slots: int, fraction: int = platforms.CPU.min_rows_fraction,
              ratio: int = RUN_RATIO["server"]) -> list[int]:
  """The active sizes (leading slots a run steps) of a decoder of `slots` slots, ascending:
  `slots` divided by `ratio` (rounded up) again and again, down to `slots` / `fraction` (at
  least 1). `ratio` is at least 2."""
  if ratio < 2:
    raise ValueError(f"run sizes shrink by a ratio of at least 2, got {ratio}")
  sizes, size = [], slots
  while size >= max(1, slots // fraction):
    sizes.append(size)
    if size == 1:
      break
    size = -(-size // ratio)
  return sorted(set(sizes))


def encode_sizes(slots: int, fraction: int = platforms.CPU.min_rows_fraction) -> list[int]:
  """The batch sizes (rows) sources are encoded in, ascending: an eighth of the slots (a
  server's few new sentences) and all of them, and where steps cost their rows (`fraction` >
  1: a CPU) the quarter and the half between, and 1 and 2: a file's last sources in a batch of
  their size, not of every slot (128 rows of width 64 took 571 ms on 2 cores), and a server's
  sentence or two that came while its slots stepped in a batch of one or two, not of four (a
  server's lane spent a quarter of its time encoding batches of 4 for them)."""
  fractions = (8, 4, 2, 1) if fraction > 1 else (8, 1)
  sizes = {max(1, slots // f) for f in fractions}
  if fraction > 1:
    sizes |= {size for size in (1, 2) if size <= slots}
  return sorted(sizes)


def chunk_rows(rows: int, width: int, tokens: int) -> int:
  """The rows of `width` tokens an encoder program computes at once, of a batch of `rows`: the
  most rows dividing `rows` that hold at most `tokens` tokens (at least 1); all with `tokens`
  0."""
  if not tokens:
    return rows
  return max(d for d in range(1, rows + 1) if rows % d == 0 and (d == 1 or d * width <= tokens))


def encode_in_chunks(encode: Callable, width: int, tokens: int, params, src: jax.Array):
  """SlotModel.encode(params, src [P, w], width), computed `chunk_rows(P, w, tokens)` rows at a
  time (lax.map); each row's state that of one pass, up to float rounding (3e-6 on the main
  job's model)."""
  rows, w = src.shape
  chunk = chunk_rows(rows, w, tokens)
  if chunk == rows:
    return encode(params, src, width)
  parts = jax.lax.map(lambda part: encode(params, part, width), src.reshape(-1, chunk, w))
  return jax.tree.map(lambda x: x.reshape(rows, *x.shape[2:]), parts)


def computes_scores(beam_size: int, scores: bool) -> bool:
  """Whether a slot decoder of `beam_size` computes its outputs' scores when asked for
  `scores` (DecodeOptions.scores): beam search ranks its beams by them, so always."""
  return scores or beam_size > 1


def where_rows(mask: jax.Array, new, old):
  """Per leading index: `new`'s rows where `mask` [U], else `old`'s (pytrees alike)."""
  return jax.tree.map(lambda n, o: jnp.where(mask.reshape(-1, *[1] * (o.ndim - 1)), n, o),
                      new, old)


class SlotDecoder:
  """`slots` searches of `beam_size` beams (1: greedy or sampling), sources of up to `width`
  tokens, outputs of up to `max_len`."""

  def __init__(self, model: SlotModel, params, slots: int, width: int, max_len: int,
               specials: search.Specials, beam_size: int = 1, alpha: float = 0.6,
               sampler=search.Greedy(), rng: jax.Array | None = None, beam_stop: str = "exact",
               programs: ProgramStore | None = None, min_rows_fraction: int | None = None,
               row_copy: str | None = None, encode_tokens: int | None = None,
               scores: bool = True, run_ratio: int = RUN_RATIO["server"]):
    """`programs`: where the compiled programs are kept for a later process (default: not).
    `min_rows_fraction`: the smallest run size, as a fraction of the slots (run_sizes; default:
    the platform's, platforms.py), the sizes above it each `run_ratio` times the next
    (RUN_RATIO). `row_copy`: how moved beams' cache rows and new sources are copied into
    place (default: the platform's, platforms.py).
    `encode_tokens`: the source tokens the encoder computes at once (0: a batch whole;
    default: the platform's, platforms.py). `scores`: whether greedy searches (and sampling)
    compute their outputs' scores (DecodeOptions.scores; without, each score is 0); beam search
    always does."""
    self.model, self.params, self.specials = model, params, specials
    self.scores = computes_scores(beam_size, scores)
    self.slots, self.width, self.max_len, self.k = slots, width, max_len, beam_size
    self.alpha, self.sampler, self.beam_stop = alpha, sampler, beam_stop
    self.rng = jax.random.PRNGKey(0) if rng is None else rng
    self.row_copy = row_copy or platforms.settings(jax.default_backend()).row_copy
    describe = repr((model.describe, slots, width, max_len, beam_size, beam_stop, sampler,
                     np.asarray(jax.random.key_data(self.rng)).tolist(), specials,
                     self.row_copy, self.scores))
    programs = ProgramStore(None) if programs is None else programs
    jit = functools.partial(programs.jit, describe=describe)
    # The encoder's programs depend on the model, the width and the chunk size alone: decoders
    # of the same width share them (a server's beam sizes).
    if encode_tokens is None:
      encode_tokens = platforms.settings(jax.default_backend()).encode_tokens
    self._encode = programs.jit(
        "slots_encode", repr((model.describe, width, encode_tokens)),
        functools.partial(encode_in_chunks, model.encode, width, encode_tokens))
    self._refill = jit("slots_refill", fn=self._refill_fn, donate_argnums=0)
    self._compact = jit("slots_compact", fn=self._compact_fn, donate_argnums=0)
    fraction = min_rows_fraction or platforms.settings(jax.default_backend()).min_rows_fraction
    self.run_sizes = run_sizes(slots, fraction, run_ratio)
    self.encode_sizes = encode_sizes(slots, fraction)
    # Source widths a batch is encoded in: multiples of 4 where steps cost their rows (a CPU),
    # of 8 on an accelerator (fewer programs to compile and load; its encoder barely notices).
    self._encode_step = 4 if fraction > 1 else 8
    self._runs = {rows: jit(f"slots_run_{rows}", fn=functools.partial(self._run_fn, rows=rows),
                            donate_argnums=1) for rows in self.run_sizes}
    self._feed = jit("slots_feed", fn=self._feed_fn, donate_argnums=1)
    self.steps_run = 0  # Decoder steps its streams ran so far,
    self.rows_stepped = 0  # and the decoder rows those steps computed (run size x beam size).
    self._count_lock = threading.Lock()
    self._empty = jit("slots_empty", fn=self._empty_fn)

  def encode_width(self, longest: int) -> int:
    """The width a batch of sources whose longest has `longest` tokens is encoded in: that,
    rounded up to a multiple of 4 on a CPU (a program per width; on the Tatoeba file's
    sources, 1.16x their tokens, against 1.31x for multiples of 8) or of 8 on an accelerator,
    at most the decoder's."""
    return min(self.width, -(-longest // self._encode_step) * self._encode_step)

  def _count(self, steps, rows: int) -> None:
    """Adds a run's `steps` of its first `rows` slots to steps_run and rows_stepped."""
    with self._count_lock:
      self.steps_run += int(steps)
      self.rows_stepped += int(steps) * rows * self.k

  def compile(self, encode_widths: Sequence[int] = (),
              stopping: Callable[[], bool] = lambda: False) -> bool:
    """Compiles (or loads), without running them, the programs of every run size, `feed` and
    `compact` and, given `encode_widths`, the encoder's (batches of every encoder size at each
    of those source widths) and `refill`'s: so that no search waits for one (a first translate
    command's, for later commands; a server's). Stops before the next program once `stopping()`
    (a server's SIGTERM then waits for one program, not for all); False if it stopped."""
    state = self._empty(self.params)
    shape = lambda *dims, dtype=np.int32: jax.ShapeDtypeStruct(dims, dtype)
    u = self.slots
    batch = lambda rows: jax.tree.map(lambda x: shape(rows, *x.shape[1:], dtype=x.dtype),
                                      state["sources"])  # What an encoder batch gives.
    queue = shape(u), shape(u), shape(u, dtype=np.float32)
    todo = [(run, (self.params, state, shape(), shape())) for run in self._runs.values()]
    todo += [(self._feed, (self.params, state, batch(u), queue, shape(), shape(), shape(),
                           shape())),
             (self._compact, (state, shape(u)))]
    for rows in self.encode_sizes if encode_widths else ():
      todo += [(self._encode, (self.params, shape(rows, width))) for width in encode_widths]
      if rows < u:  # A batch of every slot goes to the feed program.
        todo.append((self._refill, (state, batch(rows), shape(u), shape(u), shape(u),
                                    shape(u, dtype=np.float32))))
    for program, args in todo:
      if stopping():
        return False
      program.compile(*args)
    return True

  # --- the compiled programs ---------------------------------------------------------------

  def _empty_fn(self, params) -> dict[str, Any]:
    u, k, length = self.slots, self.k, self.max_len
    one = jnp.zeros((1, self.width), jnp.int32)
    source = jax.tree.map(lambda x: jnp.zeros((u, *x.shape[1:]), x.dtype),
                          self.model.encode(params, one, self.width))
    return {"cache": self.model.init_cache(params, u * k, length), "sources": source,
            "items": jnp.full((u,), -1, jnp.int32), "active": jnp.zeros((u,), bool),
            "limits": jnp.ones((u,), jnp.int32), "alpha": jnp.zeros((u,), jnp.float32),
            **self._fresh()}

  def _fresh(self) -> dict[str, Any]:
    """The search state of every slot before its first step: step 0 and, greedy, <bos> as the
    last token and nothing written; a beam search's initial beams."""
    u = self.slots
    fresh = {"t": jnp.zeros((u,), jnp.int32)}
    if self.k == 1:
      fresh.update(last=jnp.full((u,), self.specials.bos, jnp.int32),
                   done=jnp.zeros((u,), bool), logprob=jnp.zeros((u,), jnp.float32),
                   out=jnp.full((u, self.max_len), self.specials.pad, jnp.int32))
    else:
      fresh["beams"] = search.initial_beams(u, self.k, self.max_len, self.specials)
    return fresh

  def _refill_fn(self, state, sources, take, limits, items, alpha):
    """Slot u with take[u] >= 0 starts row take[u] of `sources` (encode's, [P, ...]) with
    output limit limits[u] and length penalty alpha[u] as item items[u] (what it held before
    is dropped)."""
    fill = take >= 0
    state = dict(state)
    if self.row_copy == "gather":  # Every slot's row at once (platforms.py).
      rows = jax.tree.map(lambda x: jnp.take(x, jnp.maximum(take, 0), axis=0), sources)
      state["sources"] = where_rows(fill, rows, state["sources"])
    else:
      # Only the slots filled are written (a refill of a few slots must not rewrite every
      # slot's source keys and values): one row at a time, in place.
      order = jnp.argsort(~fill, stable=True)  # The slots to fill first.

      def copy(j, held):
        slot = order[j]
        row = lambda x: jax.lax.dynamic_index_in_dim(x, take[slot], keepdims=False)
        return jax.tree.map(lambda dst, new: jax.lax.dynamic_update_index_in_dim(
            dst, row(new), slot, 0), held, sources)

      state["sources"] = jax.lax.fori_loop(0, jnp.sum(fill), copy, state["sources"])
    state["active"] = state["active"] | fill
    state["items"] = jnp.where(fill, items, state["items"])
    state["limits"] = jnp.where(fill, limits, state["limits"])
    state["alpha"] = jnp.where(fill, alpha, state["alpha"])
    fresh = self._fresh()
    state.update(where_rows(fill, fresh, {key: state[key] for key in fresh}))
    return state

  def _compact_fn(self, state, order):
    """Slot u takes what slot order[u] held (a permutation of the slots)."""
    rows = (order[:, None] * self.k + jnp.arange(self.k)[None, :]).reshape(-1)
    state = dict(state)
    cache = state.pop("cache")
    state = jax.tree.map(lambda x: jnp.take(x, order, axis=0), state)
    state["cache"] = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), cache)
    return state

  def _prefix(self, state, rows: int):
    """The state of the first `rows` slots (their cache's first rows * K rows)."""
    cut = lambda n: (lambda x: jax.lax.slice_in_dim(x, 0, n, axis=0))
    return {key: jax.tree.map(cut(rows * self.k if key == "cache" else rows), value)
            for key, value in state.items()}

  def _finished(self, state) -> jax.Array:
    """[U]: the active searches that ended (or reached their limit)."""
    at_limit = state["t"] >= state["limits"]
    if self.k == 1:
      ended = state["done"]
    else:
      penalty = search.length_penalty(state["limits"], state["alpha"])
      ended = search.beam_done((None, *state["beams"], None), penalty, self.beam_stop)
    return state["active"] & (ended | at_limit)

  def _run_fn(self, params, state, min_free, max_steps, rows: int):
    """Steps every active search until at least `min_free` slots are free or finished, until
    no search runs, or for `max_steps` steps: (state, the searches finished [U], the steps
    run, `_results_fn` of the first `rows` slots: (tokens [rows, K, L], scores [rows, K]),
    the finished searches' results). Only the first `rows` slots are stepped: every active
    search must be among them. The results come with the run, not from a program of their
    own: a server's short runs would pay a second call for each search that ends."""
    if rows == self.slots:
      state, finished, steps = self._loop(params, state, min_free, max_steps)
      return state, finished, steps, self._results_fn(state)
    part, finished, steps = self._loop(params, self._prefix(state, rows),
                                       min_free - (self.slots - rows), max_steps)
    put = lambda whole, new: jax.lax.dynamic_update_slice_in_dim(whole, new, 0, axis=0)
    state = jax.tree.map(put, state, part)
    return (state, jnp.zeros((self.slots,), bool).at[:rows].set(finished), steps,
            self._results_fn(part))

  def _loop(self, params, state, min_free, max_steps):
    """`_run_fn` over every slot of `state` (all of the decoder's, or its first ones)."""
    def cond(carry):
      steps, state, finished = carry
      running = state["active"] & ~finished
      free = jnp.sum(~state["active"]) + jnp.sum(finished)
      return jnp.any(running) & (free < min_free) & (steps < max_steps)

    def body(carry):
      steps, state, finished = carry
      state = self._step_all(params, state, state["active"] & ~finished)
      return steps + 1, state, self._finished(state)

    steps, state, finished = jax.lax.while_loop(cond, body, (jnp.int32(0), state,
                                                             self._finished(state)))
    return state, finished, steps

  def _step_all(self, params, state, running):
    """One decoder step of the searches `running` [U] (the others keep their state)."""
    model, k = self.model, self.k
    t = state["t"]
    index = jnp.repeat(t, k)  # Each row's position: its search's step.
    step = lambda tokens, cache: model.step(params, tokens, cache, state["sources"], index)
    state = dict(state)
    if k == 1:
      keys = search.row_keys(self.rng, state["items"], t)
      cache, token, done, logprob = search.sample_step(
          step, state["cache"], state["last"], ~running, state["logprob"], self.specials,
          self.sampler, keys, scores=self.scores)
      at = (jnp.arange(self.max_len)[None, :] == t[:, None]) & running[:, None]
      state.update(cache=cache, out=jnp.where(at, token[:, None], state["out"]),
                   last=jnp.where(running, token, state["last"]),
                   done=jnp.where(running, done, state["done"]),
                   logprob=jnp.where(running, logprob, state["logprob"]))
    else:
      old = (t, *state["beams"], state["cache"])
      # Only the running searches' rows are read again: what they wrote is what a moved
      # beam copies.
      new = search.beam_step(step, old, self.specials, state["alpha"], k, self.beam_stop,
                             positions_axis=self.model.cache_positions,
                             written=jnp.max(jnp.where(running, t, 0)) + 1,
                             copy=self.row_copy)
      new = search.keep_beams(~running, old, new)
      state.update(beams=new[1:6], cache=new[6])
    state["t"] = t + running
    return state

  def _feed_fn(self, params, state, encoded, queue, first, count, min_free, max_steps):
    """A run of every slot that takes its new searches itself (a file's sources, a batch of
    `slots` encoded at a time): before each step the free slots take the next rows of
    `encoded` (rows first .. count - 1; `queue`: their items, limits and alpha [P]), and a
    search that ends leaves its slot at once, its result put aside. No slot waits for the host
    to refill it, and the host sees one call per batch of sources, not one per few that end.
    Steps until `max_steps` steps are done, no search runs, or every row is taken and
    `min_free` slots are free. Returns (state, (items [N], tokens [N, K, L], scores [N, K]) of
    the searches that ended (the first `ended` of N = slots + P), ended, the next row, the
    slots' active [U] and items [U], the steps run)."""
    items_q, limits_q, alpha_q = queue
    n = self.slots + items_q.shape[0]
    tokens, scores = jax.eval_shape(self._results_fn, state)
    box = (jnp.full((n,), -1, jnp.int32), jnp.zeros((n, *tokens.shape[1:]), tokens.dtype),
           jnp.zeros((n, *scores.shape[1:]), scores.dtype))

    def fill(state, next_row):
      free = ~state["active"]
      row = next_row + jnp.cumsum(free) - 1  # The r-th free slot takes the r-th next row.
      take = jnp.where(free & (row < count), row, -1)
      at = lambda x: x[jnp.clip(take, 0)]
      state = self._refill_fn(state, encoded, take, at(limits_q), at(items_q), at(alpha_q))
      return state, next_row + jnp.sum(take >= 0)

    def retire(state, box, ended):
      finished = self._finished(state)
      tokens, scores = self._results_fn(state)
      where = jnp.where(finished, ended + jnp.cumsum(finished) - 1, n)  # n: dropped.
      put = lambda x, new: x.at[where].set(new, mode="drop")
      box = tuple(map(put, box, (state["items"], tokens, scores)))
      return dict(state, active=state["active"] & ~finished), box, ended + jnp.sum(finished)

    def cond(carry):
      steps, state, next_row, _, _ = carry
      idle = (next_row >= count) & (jnp.sum(~state["active"]) >= min_free)
      return jnp.any(state["active"]) & ~idle & (steps < max_steps)

    def body(carry):
      steps, state, next_row, box, ended = carry
      state = self._step_all(params, state, state["active"])
      state, box, ended = retire(state, box, ended)
      state, next_row = fill(state, next_row)
      return steps + 1, state, next_row, box, ended

    # Searches that ended before this call were handed back then: their slots are free.
    state = dict(state, active=state["active"] & ~self._finished(state))
    state, next_row = fill(state, first)
    steps, state, next_row, box, ended = jax.lax.while_loop(
        cond, body, (jnp.int32(0), state, next_row, box, jnp.int32(0)))
    return state, box, ended, next_row, state["active"], state["items"], steps

  def _results_fn(self, state):
    """(tokens [U, K, L], scores [U, K]) of every slot, as search.py's batch decoders give them
    (meaningful for the searches that finished)."""
    if self.k == 1:
      length = jnp.sum(state["out"] != self.specials.pad, axis=-1)
      scores = state["logprob"] / search.length_penalty(length, state["alpha"])
      return state["out"][:, None], scores[:, None]
    penalty = search.length_penalty(state["limits"], state["alpha"])
    return search.final_beams(*state["beams"], penalty, self.specials)
