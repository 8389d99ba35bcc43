"""The completions server's scheduler (as batcher.py is the translation server's): one thread
drives a LanguageSlots, putting queued sequences into free slots between runs of decoder steps
(continuous batching), dropping cancelled ones and telling each sequence its new tokens."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from absl import logging

from transformer_jax.data.tokenizer import EOS
from transformer_jax.decoding.lm_slots import LanguageSlots
from transformer_jax.serving.batcher import NotReady, QueueFull

STEPS_PER_RUN = 4  # Decoder steps between two looks of the host: a stream's pieces come this often.


class Sequence:
  """One choice being decoded: what the engine thread tells of it goes to its request's asyncio
  queue as (index, new positions [(token, logprob, top ids, top log-probabilities)], end)."""

  def __init__(self, index: int, ids: list[int], max_new: int, draw: Draw, scored: bool,
               events, loop):
    self.index, self.ids, self.max_new, self.draw = index, ids, max_new, draw
    self.scored = scored  # Whether its positions' log-probabilities are kept (logprobs).
    self._events, self._loop = events, loop
    self.cancelled = False

  def tell(self, positions, end: str | None) -> None:
    self._loop.call_soon_threadsafe(self._events.put_nowait, (self.index, positions, end))


@dataclasses.dataclass
class Stats:
  requests: int = 0
  sequences: int = 0
  tokens: int = 0  # Positions decoded: prompts' and new tokens'.
  new_tokens: int = 0
  runs: int = 0
  busy_seconds: float = 0.0
  running: int = 0
  queued: int = 0


class Engine:
  """The thread that drives one LanguageSlots: it compiles its programs (then `ready`), puts
  queued sequences into free slots between runs, drops cancelled ones, and tells each sequence
  its new tokens after every run."""

  def __init__(self, slots: LanguageSlots, max_queue: int):
    self.slots, self.max_queue = slots, max_queue
    self._pending: collections.deque[Sequence] = collections.deque()
    self._live: dict[int, Sequence] = {}
    self._told: dict[int, int] = {}  # Slot -> positions told so far (its next one to tell).
    self._wake = threading.Condition()
    self._stopping = False
    self.ready = False
    self.error: BaseException | None = None
    self._stats = Stats()
    self._thread = threading.Thread(target=self._main, name="completions", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    with self._wake:
      self._stopping = True
      self._wake.notify_all()
    self._thread.join()

  def submit(self, sequences: list[Sequence]) -> None:
    with self._wake:
      if self.error is not None:
        raise NotReady(f"the decoder stopped: {self.error!r}")
      if not self.ready or self._stopping:
        raise NotReady("stopping" if self._stopping else "still compiling (GET /ready says when)")
      if len(self._pending) + len(sequences) > self.max_queue:
        raise QueueFull(f"{len(self._pending)} sequences wait and the queue holds "
                        f"{self.max_queue} (--max_queue)")
      self._pending.extend(sequences)
      self._stats.requests += 1
      self._wake.notify_all()

  def give_up(self) -> None:
    """Tells every running and queued sequence that the server is shutting down (its request
    is then answered 503, its stream ends with an error and [DONE]), and stops decoding: what
    a server does before its shutdown time runs out, so that no request is cut off unanswered."""
    with self._wake:
      for sequence in [*self._live.values(), *self._pending]:
        sequence.tell([], "shutdown")
      self._live.clear()
      self._pending.clear()
      self._stopping = True
      self._wake.notify_all()

  def cancel(self, sequences: list[Sequence]) -> None:
    """Ends these sequences (a stop string met, a client gone): their slots free at the next
    look, those still queued never start."""
    with self._wake:
      for sequence in sequences:
        sequence.cancelled = True
      self._wake.notify_all()

  def stats(self) -> Stats:
    with self._wake:
      return dataclasses.replace(self._stats, running=len(self._live), queued=len(self._pending))

  def _main(self) -> None:
    try:
      if self.slots.compile(stopping=lambda: self._stopping):
        logging.info("ready: %d slots of up to %d positions compiled", self.slots.slots,
                     self.slots.max_len)
        self.ready = True
        self._loop()
    except BaseException as e:  # Told to every request: /health says so too.
      logging.exception("the decoder stopped")
      with self._wake:
        self.error = e
        for sequence in [*self._live.values(), *self._pending]:
          sequence.tell([], "error")
        self._live.clear()
        self._pending.clear()

  def _take(self):
    """Under the lock: (starts, drops) for the next admit; waits while nothing runs."""
    while not self._stopping and not self._pending and not self._live:
      self._wake.wait()
    drops = [slot for slot, s in self._live.items() if s.cancelled]
    for slot in drops:
      del self._live[slot]
    starts = {}
    free = (slot for slot in range(self.slots.slots) if slot not in self._live)
    while self._pending:
      sequence = self._pending[0]
      if sequence.cancelled:
        self._pending.popleft()
        continue
      slot = next(free, None)
      if slot is None:
        break
      self._pending.popleft()
      self._live[slot], self._told[slot] = sequence, 1  # Position 0 is <bos>.
      starts[slot] = (sequence.ids, sequence.max_new, sequence.draw, sequence.scored)
      self._stats.sequences += 1
    return starts, drops

  def _loop(self) -> None:
    state = self.slots.empty()
    while True:
      with self._wake:
        starts, drops = self._take()
        if self._stopping:
          for sequence in [*self._live.values(), *self._pending]:
            sequence.tell([], "cancelled")
          return
        live = dict(self._live)
      if starts or drops:
        state = self.slots.admit(state, starts, drops)
      if not live:
        continue
      rows = next(r for r in self.slots.run_sizes if r > max(live))
      began = time.monotonic()
      state, view = self.slots.run(state, rows, STEPS_PER_RUN)
      told = [self._tell(slot, sequence, view) for slot, sequence in live.items()]
      with self._wake:
        self._stats.runs += 1
        self._stats.busy_seconds += time.monotonic() - began
        self._stats.tokens += sum(positions for positions, _ in told)
        self._stats.new_tokens += sum(new for _, new in told)
        for slot in live:
          if bool(view["done"][slot]) and self._live.get(slot) is live[slot]:
            del self._live[slot]

  def _tell(self, slot: int, sequence: Sequence, view) -> tuple[int, int]:
    """Tells `sequence` its positions written since last told: (those, its new tokens)."""
    if sequence.cancelled:
      return 0, 0
    last = int(view["t"][slot])  # The last position written.
    first = self._told[slot]
    tokens = view["tokens"][slot, first:last + 1].tolist()
    if sequence.scored:
      positions = [(token, float(view["logprob"][slot, p]), view["top_ids"][slot, p].tolist(),
                    view["top_lp"][slot, p].tolist()) for p, token in enumerate(tokens, first)]
    else:
      positions = [(token, 0.0, [], []) for token in tokens]
    self._told[slot] = last + 1
    end = None
    if bool(view["done"][slot]):
      end = "stop" if positions and positions[-1][0] == EOS else "length"
    if positions or end:
      sequence.tell(positions, end)
    # New tokens as usage counts them: the prompt's positions and an ending <eos> are not.
    new = max(0, last + 1 - max(first, len(sequence.ids)))
    return len(positions), new - int(end == "stop" and new > 0)
