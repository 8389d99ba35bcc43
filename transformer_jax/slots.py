"""Decoding slots (continuous batching): a fixed number of searches over preallocated caches,
which sentences enter as others end, so that every decoder step computes rows still needed.

A batch decoder (decode.py) runs a batch until its longest output ends: the rows that ended
earlier go on computing padding, and a beam search waits for its slowest sentence. Here a
`SlotDecoder` keeps `slots` searches (one row each greedy or sampled, K rows for a beam of K),
each with its own step, output limit and source, and three compiled programs that a host loop
drives (`decode_all`):

  encode(params, src [P, w])   the next P sources' encodings, padded to the slots' width
  refill(state, ...)           free slots (empty, or their search ended) take new sources
  run(state, min_free)         steps every search until `min_free` slots are free, or none runs

Each program is compiled once for the decoder's shape (slots, source width, output length,
beam size), whatever the traffic; `encode` once per source width it meets. A sentence's
tokens and scores are those the batch decoders give it (its output limit is its own: the
caller's `limits`); sampling draws each sentence's tokens from keys of its item number and
step (decode.row_keys), so they do not depend on its neighbours either.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import decode


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


def _where(mask: jax.Array, new, old):
  """Per leading index: `new`'s rows where `mask` [U], else `old`'s (pytrees alike)."""
  return jax.tree.map(lambda n, o: jnp.where(mask.reshape(-1, *[1] * (o.ndim - 1)), n, o),
                      new, old)


class SlotDecoder:
  """`slots` searches of `beam_size` beams (1: greedy or sampling), sources of up to `width`
  tokens, outputs of up to `max_len`."""

  def __init__(self, model: SlotModel, params, slots: int, width: int, max_len: int,
               specials: decode.Specials, beam_size: int = 1, alpha: float = 0.6,
               sampler=decode.Greedy(), rng: jax.Array | None = None):
    self.model, self.params, self.specials = model, params, specials
    self.slots, self.width, self.max_len, self.k = slots, width, max_len, beam_size
    self.alpha, self.sampler = alpha, sampler
    self.rng = jax.random.PRNGKey(0) if rng is None else rng
    self._encode = jax.jit(model.encode, static_argnums=2)
    self._refill = jax.jit(self._refill_fn, donate_argnums=0)
    self._run = jax.jit(self._run_fn, donate_argnums=1)
    self._results = jax.jit(self._results_fn)
    self._empty = jax.jit(self._empty_fn)

  # --- the compiled programs ---------------------------------------------------------------

  def _empty_fn(self, params) -> dict[str, Any]:
    u, k, length = self.slots, self.k, self.max_len
    one = jnp.zeros((1, self.width), jnp.int32)
    source = jax.tree.map(lambda x: jnp.zeros((u, *x.shape[1:]), x.dtype),
                          self.model.encode(params, one, self.width))
    state = {"cache": self.model.init_cache(params, u * k, length), "sources": source,
             "items": jnp.full((u,), -1, jnp.int32), "active": jnp.zeros((u,), bool),
             "limits": jnp.ones((u,), jnp.int32), "t": jnp.zeros((u,), jnp.int32)}
    if k == 1:
      state.update(last=jnp.full((u,), self.specials.bos, jnp.int32),
                   done=jnp.zeros((u,), bool), logprob=jnp.zeros((u,), jnp.float32),
                   out=jnp.full((u, length), self.specials.pad, jnp.int32))
    else:
      state["beams"] = decode.initial_beams(u, k, length, self.specials)
    return state

  def _refill_fn(self, state, sources, take, limits, items):
    """Slot u with take[u] >= 0 starts row take[u] of `sources` (encode's, [P, ...]) with
    output limit limits[u] as item items[u] (what it held before is dropped)."""
    fill = take >= 0
    picked = jax.tree.map(lambda x: x[jnp.clip(take, 0)], sources)
    state = dict(state)
    state["sources"] = _where(fill, picked, state["sources"])
    state["active"] = state["active"] | fill
    state["items"] = jnp.where(fill, items, state["items"])
    state["limits"] = jnp.where(fill, limits, state["limits"])
    state["t"] = jnp.where(fill, 0, state["t"])
    u = self.slots
    if self.k == 1:
      fresh = {"last": jnp.full((u,), self.specials.bos, jnp.int32), "done": jnp.zeros((u,), bool),
               "logprob": jnp.zeros((u,), jnp.float32),
               "out": jnp.full((u, self.max_len), self.specials.pad, jnp.int32)}
      state.update(_where(fill, fresh, {key: state[key] for key in fresh}))
    else:
      state["beams"] = _where(fill, decode.initial_beams(u, self.k, self.max_len, self.specials),
                              state["beams"])
    return state

  def _finished(self, state) -> jax.Array:
    """[U]: the active searches that ended (or reached their limit)."""
    at_limit = state["t"] >= state["limits"]
    if self.k == 1:
      ended = state["done"]
    else:
      penalty = decode.length_penalty(state["limits"], self.alpha)
      ended = decode.beam_done((None, *state["beams"], None), penalty)
    return state["active"] & (ended | at_limit)

  def _run_fn(self, params, state, min_free):
    """Steps every active search until at least `min_free` slots are free or finished, or
    until no search runs."""
    model, k = self.model, self.k

    def cond(state):
      finished = self._finished(state)
      running = state["active"] & ~finished
      free = jnp.sum(~state["active"]) + jnp.sum(finished)
      return jnp.any(running) & (free < min_free)

    def body(state):
      running = state["active"] & ~self._finished(state)
      t = state["t"]
      index = jnp.repeat(t, k)  # Each row's position: its search's step.
      step = lambda tokens, cache: model.step(params, tokens, cache, state["sources"], index)
      state = dict(state)
      if k == 1:
        keys = decode.row_keys(self.rng, state["items"], t)
        cache, token, done, logprob = decode.sample_step(
            step, state["cache"], state["last"], ~running, state["logprob"], self.specials,
            self.sampler, keys)
        at = (jnp.arange(self.max_len)[None, :] == t[:, None]) & running[:, None]
        state.update(cache=cache, out=jnp.where(at, token[:, None], state["out"]),
                     last=jnp.where(running, token, state["last"]),
                     done=jnp.where(running, done, state["done"]),
                     logprob=jnp.where(running, logprob, state["logprob"]))
      else:
        old = (t, *state["beams"], state["cache"])
        new = decode.beam_step(step, old, self.specials, self.alpha, k)
        new = decode.keep_beams(~running, old, new)
        state.update(beams=new[1:6], cache=new[6])
      state["t"] = t + running
      return state

    return jax.lax.while_loop(cond, body, state)

  def _results_fn(self, state):
    """(tokens [U, K, L], scores [U, K]) of every slot, as decode.py's batch decoders give them
    (meaningful for the searches that finished)."""
    if self.k == 1:
      length = jnp.sum(state["out"] != self.specials.pad, axis=-1)
      scores = state["logprob"] / decode.length_penalty(length, self.alpha)
      return state["out"][:, None], scores[:, None]
    penalty = decode.length_penalty(state["limits"], self.alpha)
    return decode.final_beams(*state["beams"], penalty, self.specials)

  # --- the host loop -----------------------------------------------------------------------

  def decode_all(self, sources: list[np.ndarray], limits: list[int],
                 refill_at: int | None = None, progress: Callable[[int], None] | None = None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Decodes every source (token ids with <eos>, unpadded; each at most `width` tokens,
    output limit limits[i] at most `max_len`): [(tokens [K, L], scores [K])] in their order.
    Sources start longest first (the slots' last steps then hold the shortest), and source
    i is item i (its sampling keys).

    `refill_at`: how many free slots end a run (default: an eighth of the slots): fewer cost
    more round trips to the host, more leave slots idle. `progress(n)`: called with the number
    of sources that each run finished."""
    refill_at = refill_at or max(1, self.slots // 8)
    pending = collections.deque(sorted(range(len(sources)), key=lambda i: -len(sources[i])))
    results: list[Any] = [None] * len(sources)
    state = self._empty(self.params)
    active = np.zeros(self.slots, bool)  # The host's view: slots holding an unfinished source.
    item_of = np.full(self.slots, -1, np.int32)
    chunk: collections.deque = collections.deque()  # (row of `encoded`, item) not yet started
    encoded = None
    while pending or chunk or active.any():
      free = list(np.flatnonzero(~active))
      while free and (pending or chunk):
        if not chunk:
          encoded, chunk = self._encode_next(sources, pending)
        take = np.full(self.slots, -1, np.int32)
        while free and chunk:
          slot = free.pop(0)
          take[slot], item_of[slot] = chunk.popleft()  # (row of `encoded`, item)
          active[slot] = True
        started = take >= 0
        state = self._refill(state, encoded, take,
                             np.where(started, [limits[i] for i in item_of], 1).astype(np.int32),
                             np.where(started, item_of, -1).astype(np.int32))
      min_free = refill_at if (pending or chunk) else self.slots + 1
      state = self._run(self.params, state, np.int32(min_free))
      finished = np.asarray(self._finished(state)) & active
      if finished.any():
        tokens, scores = map(np.asarray, self._results(state))
        for slot in np.flatnonzero(finished):
          results[item_of[slot]] = (tokens[slot], scores[slot])
        active &= ~finished
        if progress:
          progress(int(finished.sum()))
    return results

  def _encode_next(self, sources: list[np.ndarray], pending: collections.deque):
    """Encodes the next `slots` pending sources as one batch of the width of its longest
    (rounded up to 8: one program per width; padded with copies to a full batch):
    (encodings, deque of (row, item))."""
    items = [pending.popleft() for _ in range(min(self.slots, len(pending)))]
    width = min(self.width, -(-max(len(sources[i]) for i in items) // 8) * 8)
    src = np.zeros((self.slots, width), np.int32)
    for row in range(self.slots):
      ids = sources[items[row % len(items)]]
      src[row, :len(ids)] = ids
    return self._encode(self.params, src, self.width), collections.deque(enumerate(items))
