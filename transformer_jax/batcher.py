"""Dynamic batching for serving: the sentences of concurrent requests joined into decoder batches.

Requests hand in sentences as token ids (a `Piece` each); one decoder thread takes the oldest
waiting piece and the other waiting pieces of its kind (source width, beam size, alpha), up to
the rows its width allows, waiting up to `max_wait` seconds for more when fewer are there, and
decodes them as one batch padded to the next of a few row counts (powers of 2). Every (width, beam size, rows)
shape is compiled before the first request is taken (`warm_up`), so no request waits on a
compilation. The queue holds at most `max_queue` pieces: a request that would overflow it is
refused whole (`QueueFull`), so memory stays bounded.

Nothing here knows the model or HTTP: `decode(src [R, W], beam_size, alpha) -> (tokens
[R, K, L], scores [R, K])` is the caller's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

Decode = Callable[[np.ndarray, int, float], tuple[np.ndarray, np.ndarray]]


class QueueFull(Exception):
  """The queue has no room for a request's sentences."""


class NotReady(Exception):
  """The decoder is still compiling its shapes, or is stopping."""


def row_buckets(full: int) -> tuple[int, ...]:
  """The row counts a batch is padded to: 1, 2, 4, 8, ... below `full`, then `full`. A padded
  row costs as much as a real one (decoding on a CPU is compute-bound from a few rows on), so
  a batch is never padded to more than twice its size."""
  buckets, rows = [], 1
  while rows < full:
    buckets.append(rows)
    rows *= 2
  return (*buckets, full)


@dataclasses.dataclass(frozen=True)
class Kind:
  """Pieces decoded together: the same source width (a multiple of 8) and decoding options."""
  width: int
  beam_size: int
  alpha: float


class Job:
  """One request's pieces; `future` gets a list of (tokens [K, L], scores [K]), one per piece
  in order, when the last of them is decoded."""

  def __init__(self, count: int):
    self.results: list = [None] * count
    self.remaining = count
    self.future: concurrent.futures.Future = concurrent.futures.Future()


@dataclasses.dataclass
class Piece:
  job: Job
  index: int  # In the job.
  ids: Sequence[int]  # Source ids with <eos>.
  kind: Kind
  arrived: float


class Batcher:
  """Joins pieces into batches and decodes them on a thread of its own."""

  def __init__(self, decode: Decode, rows: Callable[[int, int], int], max_queue: int,
               max_wait: float, join_requests: bool = True):
    """`rows(width, beam_size)`: the most rows of a batch of that kind. `join_requests`
    False decodes one request at a time (its pieces of a kind form a batch of their own)."""
    self._decode, self._rows = decode, rows
    self.max_queue, self.max_wait, self.join_requests = max_queue, max_wait, join_requests
    self._queue: collections.deque[Piece] = collections.deque()
    self._cond = threading.Condition()
    self._stopping = False
    self._thread: threading.Thread | None = None
    self.shapes_total = 0
    self.shapes_done = 0
    self.ready = False
    self.error: BaseException | None = None  # What stopped the decoder thread, if anything.

  def start(self, kinds: Sequence[tuple[int, int]]) -> None:
    """Starts the decoder thread: it compiles every (width, beam size) of `kinds` at every row
    bucket, then serves."""
    shapes = [(w, k, r) for w, k in kinds for r in row_buckets(self._rows(w, k))]
    self.shapes_total = len(shapes)
    self._thread = threading.Thread(target=self._main, args=(shapes,), name="decoder",
                                    daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Decodes what is queued, then ends the thread (and waits for it)."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join()

  def queued(self) -> int:
    return len(self._queue)

  def submit(self, pieces: Sequence[tuple[Sequence[int], Kind]]) -> Job:
    """Queues one request's pieces (ids with <eos>, kind); raises QueueFull or NotReady."""
    job = Job(len(pieces))
    now = time.monotonic()
    with self._cond:
      if self.error is not None:
        raise NotReady(f"the decoder stopped ({self.error!r}); restart the server")
      if not self.ready or self._stopping:
        raise NotReady("stopping" if self._stopping else
                       f"compiling: {self.shapes_done} of {self.shapes_total} shapes done")
      if len(self._queue) + len(pieces) > self.max_queue:
        raise QueueFull(f"{len(self._queue)} sentences are waiting and this request brings "
                        f"{len(pieces)}; the queue holds {self.max_queue} (--max_queue)")
      self._queue.extend(Piece(job, i, ids, kind, now) for i, (ids, kind) in enumerate(pieces))
      self._cond.notify_all()
    return job

  def _main(self, shapes) -> None:
    try:
      self._warm_up(shapes)
      while (batch := self._next_batch()) is not None:
        self._run(batch)
    except BaseException as e:  # noqa: BLE001 -- kept for readiness; the thread must not die mute.
      logging.exception("the decoder thread stopped")
      self.error = e
      with self._cond:
        self.ready = False
        for piece in self._queue:
          if not piece.job.future.done():
            piece.job.future.set_exception(e)
        self._queue.clear()

  def _warm_up(self, shapes) -> None:
    start = time.monotonic()
    for width, beam_size, rows in shapes:
      if self._stopping:
        return
      src = np.zeros((rows, width), np.int32)
      src[:, :2] = (3, 2)  # One token then <eos>: each row ends within a few steps.
      self._decode(src, beam_size, 0.6)
      self.shapes_done += 1
    logging.info("compiled %d decoder shapes in %.1f s; ready", len(shapes),
                 time.monotonic() - start)
    with self._cond:
      self.ready = True

  def _next_batch(self) -> list[Piece] | None:
    """The next batch (waiting for it), or None once stopping with nothing queued."""
    with self._cond:
      while True:
        if not self._queue:
          if self._stopping:
            return None
          self._cond.wait()
          continue
        first = self._queue[0]
        full = self._rows(first.kind.width, first.kind.beam_size)
        same = [p for p in self._queue if p.kind == first.kind
                and (self.join_requests or p.job is first.job)]
        wait = first.arrived + self.max_wait - time.monotonic()
        if len(same) < full and wait > 0 and self.join_requests and not self._stopping:
          self._cond.wait(wait)
          continue
        batch = same[:full]
        taken = set(map(id, batch))
        self._queue = collections.deque(p for p in self._queue if id(p) not in taken)
        return batch

  def _run(self, batch: list[Piece]) -> None:
    kind = batch[0].kind
    rows = next(r for r in row_buckets(self._rows(kind.width, kind.beam_size))
                if r >= len(batch))
    src = np.zeros((rows, kind.width), np.int32)
    for i, piece in enumerate(batch):
      src[i, :len(piece.ids)] = piece.ids
    src[len(batch):] = src[0]  # Padding rows: copies of the first (their output is dropped).
    try:
      tokens, scores = self._decode(src, kind.beam_size, kind.alpha)
    except Exception as e:  # noqa: BLE001 -- a failed batch fails its requests, not the server.
      logging.exception("decoding a batch of %d failed", len(batch))
      for piece in batch:
        if not piece.job.future.done():
          piece.job.future.set_exception(e)
      return
    for i, piece in enumerate(batch):
      job = piece.job
      if job.future.done():  # Another of its pieces failed.
        continue
      job.results[piece.index] = (tokens[i], scores[i])
      job.remaining -= 1
      if not job.remaining:
        job.future.set_result(job.results)
