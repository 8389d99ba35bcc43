"""Decoding slots for a language model (continuous batching of completions): `slots` sequences
over one preallocated cache, each with its own prompt, position, output limit and sampling
settings, which a host loop starts and stops between runs of decoder steps (serving's
completions engine).

A slot reads its prompt in chunks, then feeds back what it draws; the step that reads the
prompt's last token draws the first new one. Each step, beside every running row's decoding
position, the lowest slot with more of its prompt to read reads a chunk of it in one pass (the
narrowest of the platform's `prompt_chunks` widths that holds the rest, else the widest; the
widest only while no other sequence decodes), so a long prompt is read in a few steps and
never stalls the running sequences for longer than one chunk. Every row steps at its own
position (the cache's index is per row), so a sequence joins while others are halfway and
leaves when it ends, its slot free for the next. A sequence's i-th new token draws with the
key fold_in(fold_in(PRNGKey(seed), item), i), the key `generate` gives prompt number `item` of
its input: the same seed draws the same text in any slot, beside any others,
and greedy rows (temperature 0) choose what `generate` chooses.

Programs (compiled once for the decoder's shape, whatever the traffic):
  admit(state, start [U], drop [U], prompts [U, L], ...)  slots start new sequences or end theirs
  run_R(params, state, max_steps)  steps the first R slots (every live sequence must be among
                                   them) until one ends, none runs, or `max_steps` steps are done
R is one of `run_sizes` (slots, then halves, on a CPU down to a sixteenth): a step computes about
as many rows as are busy, not as many as were allocated; new sequences take the lowest free
slots, so that few busy ones run in a small program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax.data.tokenizer import EOS
from transformer_jax.decoding import platforms, search, slots as slots_lib
from transformer_jax.decoding.prompts import NEVER_CONTINUED
from transformer_jax.models.transformer import LanguageModel
from transformer_jax.programs import ProgramStore

TOP = 5  # The most likely tokens whose log-probabilities each position keeps (OpenAI's limit).


@dataclasses.dataclass(frozen=True)
class Draw:
  """How a sequence chooses its tokens: temperature 0 greedy; else sampling at `temperature`
  from the `top_k` (0: all) most likely whose cumulative probability reaches `top_p`."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  item: int = 0  # The sequence's number among its request's: its draws' key.


def sample_rows(logits, keys, temperature, top_k, top_p):
  """logits [R, V], keys [R], each row's settings [R] -> tokens [R]: search.Sampling's draw
  (search.Greedy's where temperature is 0) with settings of its own for each row. The sorts
  that top-k and top-p need run only when a row asks for them, the draw only when a row
  samples: on 2 cores a step of 16 rows took 12.5 ms with both always, 3.4 ms sampling
  without them, 2.3 ms greedy."""
  greedy = search.Greedy()(logits, keys)

  def draw(_):
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filters = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
    scaled = lax.cond(filters, lambda x: _filtered(x, top_k, top_p), lambda x: x, scaled)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

  drawn = lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
  return jnp.where(temperature > 0, drawn, greedy)


def _filtered(scaled, top_k, top_p):
  """Each row's logits outside its top_k (0: none cut) and then its nucleus top_p (1.0: none
  cut) set to NEG_INF, as search.Sampling cuts them."""
  descending = jnp.sort(scaled, axis=-1)[:, ::-1]
  kth = jnp.take_along_axis(descending, jnp.clip(top_k - 1, 0)[:, None], axis=-1)
  scaled = jnp.where((top_k[:, None] > 0) & (scaled < kth), search.NEG_INF, scaled)
  descending = jnp.sort(scaled, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(descending, axis=-1)
  # The most likely always (a top_p below float32's normal range flushes to 0 on a CPU).
  first = jnp.arange(probs.shape[-1]) == 0
  keep = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | first
  threshold = jnp.min(jnp.where(keep, descending, jnp.inf), axis=-1, keepdims=True)
  nucleus = jnp.where(scaled < threshold, search.NEG_INF, scaled)
  return jnp.where(top_p[:, None] < 1.0, nucleus, scaled)


class LanguageSlots:
  """`slots` sequences of up to `max_len` positions (prompt and new tokens) of a LanguageModel
  whose tokenizer has `vocab` ids."""

  def __init__(self, model: LanguageModel, params, slots: int, max_len: int, vocab: int,
               programs: ProgramStore | None = None, min_rows_fraction: int | None = None,
               prompt_chunks: tuple[int, ...] = ()):
    self.model, self.params, self.slots, self.max_len, self.vocab = (
        model, params, slots, max_len, vocab)
    fraction = min_rows_fraction or platforms.settings(jax.default_backend()).min_rows_fraction
    self.run_sizes = slots_lib.run_sizes(slots, fraction)
    chunks = prompt_chunks or platforms.settings(jax.default_backend()).prompt_chunks
    self.chunks = tuple(sorted({max(1, min(c, max_len - 2)) for c in chunks}))
    describe = repr((model.cfg, slots, max_len, vocab, self.chunks))
    programs = ProgramStore(None) if programs is None else programs  # None: nothing kept.
    jit = functools.partial(programs.jit, describe=describe)
    self._admit = jit("lm_slots_admit", fn=self._admit_fn, donate_argnums=0)
    self._runs = {rows: jit(f"lm_slots_run_{rows}", fn=functools.partial(self._run_fn, rows=rows),
                            donate_argnums=1) for rows in self.run_sizes}
    self._empty = jit("lm_slots_empty", fn=self._empty_fn)

  # --- the host's side ---------------------------------------------------------------------

  def empty(self):
    """The state of free slots."""
    return self._empty(self.params)

  def compile(self, stopping=lambda: False) -> bool:
    """Compiles (or loads) every program without running it; False if `stopping()` stopped it
    before the last."""
    state = jax.eval_shape(self._empty_fn, self.params)
    shape = lambda *dims, dtype=np.int32: jax.ShapeDtypeStruct(dims, dtype)
    u, length = self.slots, self.max_len
    todo = [(self._admit, (state, *self._admit_shapes(shape, u, length)))]
    todo += [(run, (self.params, state, shape())) for run in self._runs.values()]
    for program, args in todo:
      if stopping():
        return False
      program.compile(*args)
    return True

  @staticmethod
  def _admit_shapes(shape, u, length):
    return (shape(u, dtype=bool), shape(u, dtype=bool), shape(u, length), shape(u), shape(u),
            shape(u, 2, dtype=np.uint32), shape(u), shape(u, dtype=np.float32), shape(u),
            shape(u, dtype=np.float32), shape(u, dtype=bool))

  def admit(self, state, starts: dict[int, tuple[list[int], int, Draw, bool]], drops=()):
    """Slot u of `starts` begins the sequence (ids: <bos> + the prompt's, the most new tokens,
    its Draw, whether it keeps log-probabilities); the slots in `drops` end theirs (free from
    then on)."""
    u, length = self.slots, self.max_len
    start, drop = np.zeros(u, bool), np.zeros(u, bool)
    prompts = np.zeros((u, length), np.int32)
    lengths, last, items, top_k = (np.zeros(u, np.int32) for _ in range(4))
    keys = np.zeros((u, 2), np.uint32)
    temperature, top_p = np.zeros(u, np.float32), np.ones(u, np.float32)
    scored = np.zeros(u, bool)
    for slot, (ids, max_new, draw, scored[slot]) in starts.items():
      start[slot] = True
      prompts[slot, :len(ids)] = ids
      lengths[slot] = len(ids)
      last[slot] = min(len(ids) - 1 + max_new, length - 1)
      keys[slot] = np.asarray(jax.random.PRNGKey(draw.seed))
      items[slot], temperature[slot] = draw.item, draw.temperature
      top_k[slot], top_p[slot] = draw.top_k, draw.top_p
    drop[list(drops)] = True
    return self._admit(state, start, drop, prompts, lengths, last, keys, items, temperature,
                       top_k, top_p, scored)

  def run(self, state, rows: int, max_steps: int):
    """Steps the first `rows` slots (a run size) until a sequence ends, none runs, or
    `max_steps` steps are done: (state, its first `rows` slots' host copy: tokens, t, done,
    active, logprob, top_ids, top_lp)."""
    state, view = self._runs[rows](self.params, state, np.int32(max_steps))
    return state, jax.device_get(view)

  # --- the compiled programs ---------------------------------------------------------------

  def _empty_fn(self, params):
    u, length = self.slots, self.max_len
    cache = self.model.apply({"params": params}, u, length, method=LanguageModel.init_cache)
    zeros = lambda *dims, dtype=jnp.int32: jnp.zeros(dims, dtype)
    return {"k": cache["k"], "v": cache["v"], "tokens": zeros(u, length), "t": zeros(u),
            "length": zeros(u), "last": zeros(u), "active": zeros(u, dtype=bool),
            "done": zeros(u, dtype=bool), "keys": zeros(u, 2, dtype=jnp.uint32),
            "items": zeros(u), "temperature": zeros(u, dtype=jnp.float32), "top_k": zeros(u),
            "top_p": jnp.ones((u,), jnp.float32), "scored": zeros(u, dtype=bool),
            "logprob": zeros(u, length, dtype=jnp.float32),
            "top_ids": zeros(u, length, TOP), "top_lp": zeros(u, length, TOP, dtype=jnp.float32)}

  def _admit_fn(self, state, start, drop, prompts, lengths, last, keys, items, temperature,
                top_k, top_p, scored):
    state = dict(state)
    fresh = {"tokens": prompts, "t": jnp.zeros_like(lengths), "length": lengths, "last": last,
             "done": jnp.zeros_like(start), "keys": keys, "items": items,
             "temperature": temperature, "top_k": top_k, "top_p": top_p, "scored": scored}
    for name, value in fresh.items():
      state[name] = slots_lib.where_rows(start, value, state[name])
    state["active"] = (state["active"] & ~drop) | start
    return state

  def _view(self, state):
    return {name: state[name] for name in ("tokens", "t", "done", "active", "logprob",
                                          "top_ids", "top_lp")}

  def _run_fn(self, params, state, max_steps, rows: int):
    cut = lambda x: lax.slice_in_dim(x, 0, rows, axis=0)
    part = jax.tree.map(cut, state)

    def cond(carry):
      steps, part, ended = carry
      return jnp.any(part["active"] & ~part["done"]) & (steps < max_steps) & ~ended

    def body(carry):
      steps, part, _ = carry
      before = part["done"]
      part = self._step(params, part)
      return steps + 1, part, jnp.any(part["done"] & ~before)

    _, part, _ = lax.while_loop(cond, body, (jnp.int32(0), part, jnp.bool_(False)))
    put = lambda whole, new: lax.dynamic_update_slice_in_dim(whole, new, 0, axis=0)
    return jax.tree.map(put, state, part), self._view(part)

  def _read_chunk(self, params, s, reading):
    """The lowest slot of `reading` [R] reads the next chunk of its prompt in one pass, up to
    (not including) its last token: what it writes and t move past the chunk, as the chunk's
    steps one position at a time would have left them. The width is the narrowest of
    `self.chunks` that holds the rest, else the widest, or the next to widest where other
    sequences are decoding (a step of every width in one program)."""
    r = jnp.argmax(reading)
    left = s["length"][r] - 1 - s["t"][r]  # Positions before the last prompt token.
    widths = jnp.array(self.chunks)
    # The widest chunk only where no sequence decodes meanwhile (none waits for it).
    decoding = jnp.any(s["active"] & ~s["done"] & ~reading)
    widest = len(self.chunks) - 1 - (decoding & (len(self.chunks) > 1))
    branch = jnp.minimum(jnp.searchsorted(widths, left), widest)
    reads = [functools.partial(self._chunk, width=w) for w in self.chunks]
    return lax.switch(branch, reads, params, s, r)

  def _chunk(self, params, s, r, width: int):
    """Slot r reads `width` positions from its t on, of which the first n = min(width, left)
    are its prompt's (the others compute what no one reads)."""
    t, length = s["t"][r], s["length"][r]
    n = jnp.minimum(width, length - 1 - t)
    at = jnp.minimum(t + jnp.arange(width + 1), self.max_len - 1)  # Read, and the next.
    tokens = s["tokens"][r][at]  # [width + 1]
    row = lambda x: lax.dynamic_slice_in_dim(x, r, 1, axis=0)
    y, cache = self.model.apply(
        {"params": params}, tokens[None, :width],
        {"index": t[None], "k": jax.tree.map(row, s["k"]), "v": jax.tree.map(row, s["v"])},
        method=LanguageModel.cached_features)  # y [1, width, D]
    put = lambda whole, part: lax.dynamic_update_slice_in_dim(whole, part, r, axis=0)
    s = dict(s, k=jax.tree.map(put, s["k"], cache["k"]),
             v=jax.tree.map(put, s["v"], cache["v"]), t=s["t"].at[r].add(n))

    def scores(s):  # The prompt's next tokens' log-probabilities, as the steps keep them.
      logits = self.model.apply({"params": params}, y, method=LanguageModel.project)[0]
      logp = jax.nn.log_softmax(logits[:, :self.vocab].at[:, NEVER_CONTINUED].set(
          search.NEG_INF))  # [width, V]
      chosen = jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]
      top_lp, top_ids = lax.top_k(logp, TOP)
      # Positions t + 1 .. t + n; the chunk's others are dropped.
      written = jnp.where(jnp.arange(width) < n, t + 1 + jnp.arange(width), self.max_len)
      write = lambda x, value: x.at[r, written].set(value, mode="drop")
      return dict(s, logprob=write(s["logprob"], chosen), top_ids=write(s["top_ids"], top_ids),
                  top_lp=write(s["top_lp"], top_lp))

    return lax.cond(s["scored"][r], scores, lambda s: s, s)

  def _step(self, params, s):
    """One position of every running row: it reads its token at t and writes the one at t + 1
    (its prompt's, or the one it draws once the prompt is read). Before it, one row with more
    of its prompt to read than the last token reads the next chunk of it (`_read_chunk`)."""
    reading = s["active"] & ~s["done"] & (s["t"] < s["length"] - 1)
    s = lax.cond(jnp.any(reading), lambda s: self._read_chunk(params, s, reading), lambda s: s,
                 s)
    rows = jnp.arange(s["t"].shape[0])
    running = s["active"] & ~s["done"]
    t, length = s["t"], s["length"]
    feed = s["tokens"][rows, t]
    logits, cache = self.model.apply(
        {"params": params}, feed[:, None], {"index": t, "k": s["k"], "v": s["v"]},
        method=LanguageModel.decode_step)
    logits = logits[:, :self.vocab].at[:, NEVER_CONTINUED].set(search.NEG_INF)
    p = t + 1  # The position this step writes.
    new = p - length  # Its index among the new tokens (< 0: the prompt's).
    fold = lambda key, item, i: jax.random.fold_in(jax.random.fold_in(key, item), i)
    keys = jax.vmap(fold)(s["keys"], s["items"], jnp.maximum(new, 0))
    drawn = sample_rows(logits, keys, s["temperature"], s["top_k"], s["top_p"])
    at = jnp.minimum(p, self.max_len - 1)
    token = jnp.where(new >= 0, drawn, s["tokens"][rows, at])

    def scores(_):  # Only on steps where a running row keeps them (logprobs).
      logp = jax.nn.log_softmax(logits)
      return (logp[rows, token], *lax.top_k(logp, TOP))  # Chosen, top values, top ids.

    def unscored(_):
      r = logits.shape[0]
      return (jnp.zeros((r,), jnp.float32), jnp.zeros((r, TOP), jnp.float32),
              jnp.zeros((r, TOP), jnp.int32))

    chosen, top_lp, top_ids = lax.cond(jnp.any(running & s["scored"]), scores, unscored, None)
    write = lambda x, value: x.at[rows, at].set(jnp.where(
        running.reshape(-1, *[1] * (value.ndim - 1)), value, x[rows, at]))
    generating = running & (new >= 0)
    return dict(
        s, k=cache["k"], v=cache["v"], tokens=write(s["tokens"], token),
        logprob=write(s["logprob"], chosen), top_ids=write(s["top_ids"], top_ids),
        top_lp=write(s["top_lp"], top_lp), t=t + running,
        done=s["done"] | (generating & ((token == EOS) | (p >= s["last"]))))
