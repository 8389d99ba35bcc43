"""The host side of decoding slots: what feeds sources into a SlotDecoder's programs and takes
the finished searches out. `decode_all` and `decode_jobs` decode a file's sources in lanes
(streams of slots, each driven by a thread of its own: `translate`); a `SlotStream` takes
sources as they come and hands them back as they finish (`serve`)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from transformer_jax.decoding.slots import SlotDecoder


def decode_all(decoder: SlotDecoder, sources: list[np.ndarray], limits: list[int],
               alpha: float | None = None, refill_at: int | None = None,
               progress: Callable[[int], None] | None = None, lanes: int = 1
               ) -> list[tuple[np.ndarray, np.ndarray]]:
  """Decodes every source (token ids with <eos>, unpadded; each at most `width` tokens,
  output limit limits[i] at most `max_len`) with length penalty `alpha` (default: the
  decoder's): [(tokens [K, L], scores [K])] in their order. Sources start longest first (the
  slots' last steps then hold the shortest), and source i is item i (its sampling keys).

  `refill_at`: how many free slots end a run while sources wait (default: an eighth of the
  slots): fewer cost more round trips to the host, more leave slots idle. `progress(n)`:
  called with the number of sources each run finished (from the lanes' threads).

  `lanes`: streams of `slots` slots each that decode the sources at once, each in a thread
  of its own (decode_jobs)."""
  job = Job(decoder, sources, limits, decoder.alpha if alpha is None else alpha)
  return decode_jobs([job], refill_at, progress, lanes)[0]


@dataclasses.dataclass(frozen=True)
class Job:
  """Sources for one decoder (decode_all's arguments): their output limits and length penalty."""
  decoder: SlotDecoder
  sources: list[np.ndarray]
  limits: list[int]
  alpha: float


def decode_jobs(jobs: list[Job], refill_at: int | None = None,
                progress: Callable[[int], None] | None = None, lanes: int = 1
                ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
  """Decodes the jobs' sources (SlotDecoder.decode_all, per job) in `lanes` streams at once,
  each driven by a thread of its own through the jobs: a lane takes a job's sources, longest
  first, a batch of its slots at a time as its slots free up, and goes on to its next job once
  none is left to take and its own searches have ended, without waiting for the other lanes.
  Every other lane goes through the jobs in reverse order, so that lanes decode different jobs
  at once until they meet: translate's width classes then share the cores (a wide class's
  steps wait on memory, a narrow one's compute), their programs load while the other lane
  decodes, and their last few searches do not all run at the same time (docs/translating.md).
  Returns each job's results, in its sources' order."""
  results = [[None] * len(job.sources) for job in jobs]
  longest_first = lambda job: sorted(range(len(job.sources)), key=lambda i: -len(job.sources[i]))
  pending = [collections.deque(longest_first(job)) for job in jobs]
  lock, stop = threading.Lock(), threading.Event()

  def take(j: int, n: int) -> list[int]:
    with lock:
      return [pending[j].popleft() for _ in range(min(n, len(pending[j])))]

  def lane(order) -> None:
    for j in order:
      if stop.is_set():  # Another lane failed: no new stream.
        return
      if not pending[j]:  # The other lanes took them all (none comes back).
        continue
      job = jobs[j]
      d = job.decoder
      stream = SlotStream(d)
      while not stop.is_set():
        if not stream.waiting:  # At most one encoder batch waits beside the slots.
          for i in take(j, d.slots):
            stream.put(i, job.sources[i], job.limits[i], job.alpha)
        if not stream.busy:
          break
        # While the job has sources to take, a run ends as soon as a slot is free and the
        # stream has none left to give it (the feed program's runs); at the job's end, once
        # `refill_at` are free (fewer host round trips), or when every search has ended.
        finished = stream.advance(1 if pending[j] else (refill_at or max(1, d.slots // 8))
                                  if stream.waiting else d.slots + 1)
        for item, tokens, scores in finished:
          results[j][item] = (tokens, scores)
        if progress and finished:
          progress(len(finished))

  most = max((len(job.sources) for job in jobs), default=0)
  forward = list(range(len(jobs)))
  run_lanes([functools.partial(lane, forward[::-1] if k % 2 else forward)
             for k in range(max(1, min(lanes, most)))], stop)
  return results


def run_lanes(work: list[Callable[[], None]], stop: threading.Event) -> None:
  """Runs each of `work` in a thread of its own (the first in this one) and waits for all.
  An exception in any (a Ctrl-C in this thread included) sets `stop`, which the others check
  between runs, and is raised here once they have stopped."""
  errors: list[BaseException] = []

  def guarded(fn):
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 -- raised again in the calling thread.
      errors.append(e)
      stop.set()

  threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in work[1:]]
  for thread in threads:
    thread.start()
  try:
    if work:
      guarded(work[0])
    for thread in threads:
      while thread.is_alive():
        thread.join(0.1)
  except BaseException:
    stop.set()
    raise
  if errors:
    raise errors[0]


class SlotStream:
  """Sources fed into one decoder's slots as they come, handed back as they finish.

  `put` queues a source; `advance` starts queued sources in the free slots (encoding them a
  batch of `slots` at a time), runs the searches, and returns those that finished. Not
  thread-safe: one thread drives a stream."""

  def __init__(self, decoder: SlotDecoder):
    self.decoder = decoder
    self._state = decoder._empty(decoder.params)
    self._active = np.zeros(decoder.slots, bool)  # Slots holding an unfinished search.
    self._item = np.zeros(decoder.slots, np.int64)
    self._queue: collections.deque = collections.deque()  # (item, ids, limit, alpha)
    self._encoded = None
    self._whole = False
    self._chunk: collections.deque = collections.deque()  # (row of _encoded, item, limit, alpha)

  def put(self, item: int, ids: np.ndarray, limit: int, alpha: float) -> None:
    """Queues source `ids` (with <eos>, at most the decoder's width) as `item`, with its output
    limit (at most the decoder's max_len) and length penalty."""
    self._queue.append((item, ids, limit, alpha))

  @property
  def waiting(self) -> int:
    """Sources queued and not yet in a slot."""
    return len(self._queue) + len(self._chunk)

  @property
  def running(self) -> int:
    return int(self._active.sum())

  @property
  def busy(self) -> bool:
    return bool(self.waiting or self.running)

  def advance(self, min_free: int, max_steps: int | None = None) -> list[tuple[int, Any, Any]]:
    """Fills the free slots, then steps until `min_free` slots are free (finished or empty),
    no search runs, or `max_steps` steps (default: the decoder's max_len) are done. Returns
    (item, tokens [K, L], scores [K]) of the searches that finished.

    A batch of `slots` sources encoded at once (a file's) goes to the feed program instead:
    its sources take the slots that free up between two steps, within one call, which ends
    once none is left to take and `min_free` slots are free (one, while more sources are
    queued), or after `max_steps` (default: no limit)."""
    d = self.decoder
    if self.waiting:
      if not self._chunk:
        self._encode_next()
      if self._whole:
        return self._feed(min_free, max_steps)
    free = list(np.flatnonzero(~self._active))
    while free and self.waiting:
      if not self._chunk:
        self._encode_next()
      take = np.full(d.slots, -1, np.int32)
      limits, items = np.ones(d.slots, np.int32), np.full(d.slots, -1, np.int32)
      alpha = np.zeros(d.slots, np.float32)
      while free and self._chunk:
        slot = free.pop(0)
        take[slot], item, limits[slot], alpha[slot] = self._chunk.popleft()
        items[slot] = self._item[slot] = item
        self._active[slot] = True
      self._state = d._refill(self._state, self._encoded, take, limits, items, alpha)
    rows = self._compacted()
    smaller = [size for size in d.run_sizes if size < rows]
    if smaller:  # Back once the searches still running fit the next smaller size.
      min_free = min(min_free, d.slots - smaller[-1])
    self._state, finished, steps, results = d._runs[rows](
        d.params, self._state, np.int32(min_free), np.int32(max_steps or d.max_len))
    d._count(steps, rows)
    finished = np.asarray(finished) & self._active
    if not finished.any():
      return []
    tokens, scores = map(np.asarray, results)
    self._active &= ~finished
    return [(int(self._item[s]), tokens[s], scores[s]) for s in np.flatnonzero(finished)]

  def warm_one(self, encode_widths: Sequence[int]) -> None:
    """Compiles (or loads) and calls what one source needs at each of `encode_widths`: the
    encoder for one row of that width, a refill and the smallest run (a server's first
    requests); the rest is warm_up's. Leaves the stream as it found it."""
    d = self.decoder
    for width in encode_widths:
      self.put(-1, np.array([3] * (width - 1) + [d.specials.eos], np.int32), 2, d.alpha)
      self._drain()

  def _drain(self) -> None:
    """Runs until every search put in has ended (the warm-ups' few short ones)."""
    while self.busy:
      self.advance(min_free=self.decoder.slots + 1)

  def warm_up(self, encode_widths: Sequence[int],
              stopping: Callable[[], bool] = lambda: False) -> None:
    """Compiles (or loads) the decoder's programs (SlotDecoder.compile) and calls them once,
    the encoder's at each of `encode_widths`: a program's first call costs more than its later
    ones (on a CPU, XLA's YNN fusions build their kernels then: 40-100 ms for an encoder's),
    better paid here than by the first sentences. Leaves the stream as it found it.

    The encoder's batches of over a quarter of the slots are left to traffic: only a load
    that fills the slots meets them, and calling each here (on 2 cores, 0.3-0.8 s for 64 and
    128 sources of 36-64 tokens) would slow the start more than it speeds such a load.

    `stopping()` is asked between programs and calls: once it is true, this returns."""
    d = self.decoder
    if not d.compile(encode_widths, stopping):
      return
    for width in encode_widths:
      if stopping():
        return
      src = np.zeros((d.slots, width), np.int32)
      src[:, :2] = (3, d.specials.eos)  # A token, then <eos>.
      for rows in [rows for rows in d.encode_sizes if rows <= max(1, d.slots // 4)]:
        jax.block_until_ready(d._encode(d.params, src[:rows]))
    # Searches that run `rows` at a time and end within 2 steps, their sources as wide as an
    # encoder program compiled above. (A run of every slot is left out: `slots` sources put
    # at once go to the feed program, which this calls.)
    ids = np.array([3] * (min(encode_widths, default=2) - 1) + [d.specials.eos], np.int32)
    for rows in d.run_sizes:
      if stopping():
        return
      for n in range(rows):
        self.put(-1 - n, ids, 2, d.alpha)
      self._drain()

  def _feed(self, min_free: int, max_steps: int | None) -> list[tuple[int, Any, Any]]:
    """advance() by the decoder's feed program: the searches take the encoded batch's waiting
    rows into their slots as these free up."""
    d = self.decoder
    first = self._chunk[0][0]
    queue = np.zeros(d.slots, np.int32), np.ones(d.slots, np.int32), np.zeros(d.slots, np.float32)
    for row, item, limit, alpha in self._chunk:
      queue[0][row], queue[1][row], queue[2][row] = item, limit, alpha
    self._state, box, ended, next_row, active, items, steps = d._feed(
        d.params, self._state, self._encoded, queue, np.int32(first),
        # Sources queued beyond the batch: once it is taken, the first free slot ends the call,
        # so that they are encoded then.
        np.int32(first + len(self._chunk)), np.int32(1 if self._queue else min_free),
        np.int32(max_steps or np.iinfo(np.int32).max))
    d._count(steps, d.slots)
    for _ in range(int(next_row) - first):
      self._chunk.popleft()
    self._active, self._item = np.array(active), np.array(items, np.int64)
    ended = int(ended)
    if not ended:
      return []
    box_items, tokens, scores = (np.asarray(x)[:ended] for x in box)
    return [(int(box_items[i]), tokens[i], scores[i]) for i in range(ended)]

  def _compacted(self) -> int:
    """The smallest run size that holds the active searches, after moving them to the first
    slots if one lies beyond it."""
    d = self.decoder
    rows = next(size for size in d.run_sizes if size >= self._active.sum())
    if self._active[rows:].any():
      order = np.concatenate([np.flatnonzero(self._active), np.flatnonzero(~self._active)])
      self._state = d._compact(self._state, order.astype(np.int32))
      self._active, self._item = self._active[order], self._item[order]
    return rows

  def _encode_next(self) -> None:
    """Encodes the next queued sources, at most `slots`, as one batch of `encode_width` of its
    longest and of the fewest rows of `encode_sizes` that hold them (a
    server's few new sentences, a file's last ones): a program per (rows, width). Padded with
    copies."""
    d = self.decoder
    batch = [self._queue.popleft() for _ in range(min(d.slots, len(self._queue)))]
    width = d.encode_width(max(len(ids) for _, ids, _, _ in batch))
    rows = next(size for size in d.encode_sizes if size >= len(batch))
    src = np.zeros((rows, width), np.int32)
    for row in range(rows):
      ids = batch[row % len(batch)][1]
      src[row, :len(ids)] = ids
    self._encoded = d._encode(d.params, src)
    self._whole = rows == d.slots  # A batch of every slot: the feed program takes it in.
    self._chunk = collections.deque((row, item, limit, alpha)
                                    for row, (item, _, limit, alpha) in enumerate(batch))
