"""Dynamic batching for serving: the sentences of concurrent requests joined into decoder batches.

Requests hand in sentences as token ids (a `Piece` each); a decoder thread takes the oldest
waiting piece and the other waiting pieces with its decoding options (beam size, alpha): those
of its source width first, then (`join_widths`) those of other widths, up to the rows the
batch's width (its widest piece's) allows, waiting up to `max_wait` seconds for more when
fewer are there, and decodes them as one batch padded to the next of a few row counts (powers
of 2). Each row keeps its own width's output limit, so what a piece is batched with does not
change how long its output may be. `decoders` threads do this at once, each batch taking its
share of the waiting pieces: on a CPU one batch's decoding loop leaves cores idle between its
small steps, and a second batch fills them. Every (width, beam size, rows) shape is compiled
before the first request is taken (`warm_up`), so no request waits on a compilation. The queue
holds at most `max_queue` pieces: a request that would overflow it is refused whole
(`QueueFull`), so memory stays bounded.

Nothing here knows the model or HTTP: `decode(src [R, W], widths [R], beam_size, alpha) ->
(tokens [R, K, L], scores [R, K])` is the caller's, `widths` being each row's own width (at
most W).
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

Decode = Callable[[np.ndarray, np.ndarray, int, float], tuple[np.ndarray, np.ndarray]]


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
  """A piece's source width (a multiple of 8) and decoding options: pieces of the same options
  share batches (of one width unless `join_widths`)."""
  width: int
  beam_size: int
  alpha: float


class Job:
  """One request's pieces; `future` gets a list of (tokens [K, L], scores [K]), one per piece
  in order, when the last of them is decoded, or the exception of the first that failed. Its
  methods are called under the batcher's lock; the future is set outside it."""

  def __init__(self, count: int):
    self.results: list = [None] * count
    self.remaining = count
    self.failed = False
    self.future: concurrent.futures.Future = concurrent.futures.Future()

  def add(self, index: int, result) -> bool:
    """Records one piece's result; True when that completes the job (set its future)."""
    if self.failed:
      return False
    self.results[index] = result
    self.remaining -= 1
    return not self.remaining

  def claim_failure(self) -> bool:
    """Marks the job failed; True the first time (set its future's exception then)."""
    if self.failed or not self.remaining:
      return False
    self.failed = True
    return True


@dataclasses.dataclass
class Stats:
  """What the decoder threads did since start-up (warm-up not counted)."""
  batches: int = 0
  sentences: int = 0
  rows: int = 0  # Padded rows included.
  decode_s: float = 0.0  # Summed over the threads.

  def add(self, sentences: int, rows: int, seconds: float) -> None:
    self.batches += 1
    self.sentences += sentences
    self.rows += rows
    self.decode_s += seconds


@dataclasses.dataclass
class Piece:
  job: Job
  index: int  # In the job.
  ids: Sequence[int]  # Source ids with <eos>.
  kind: Kind
  arrived: float


def submit(batcher: "Batcher | SlotBatcher", pieces: Sequence[tuple[Sequence[int], Kind]]) -> Job:
  """Queues one request's pieces (ids with <eos>, kind) with a batcher; raises QueueFull or
  NotReady."""
  job = Job(len(pieces))
  now = time.monotonic()
  with batcher._cond:
    if batcher.error is not None:
      raise NotReady(f"the decoder stopped ({batcher.error!r}); restart the server")
    if not batcher.ready or batcher._stopping:
      raise NotReady("stopping" if batcher._stopping else
                     f"compiling: {batcher.shapes_done} of {batcher.shapes_total} shapes done")
    queued = batcher.queued()
    if queued + len(pieces) > batcher.max_queue:
      raise QueueFull(f"{queued} sentences are waiting and this request brings {len(pieces)} "
                      "(a line cut at its sentence ends brings one a sentence); the queue holds "
                      f"{batcher.max_queue} (--max_queue)")
    batcher._append([Piece(job, i, ids, kind, now) for i, (ids, kind) in enumerate(pieces)])
    batcher._cond.notify_all()
  return job


class Batcher:
  """Joins pieces into batches and decodes them on threads of its own."""

  def __init__(self, decode: Decode, rows: Callable[[int, int], int], max_queue: int,
               max_wait: float, join_requests: bool = True, decoders: int = 1,
               join_widths: bool = True):
    """`rows(width, beam_size)`: the most rows of a batch of that width. `join_requests`
    False decodes one request at a time (its pieces form batches of their own). `decoders`:
    batches decoded at once, each by a thread of its own. `join_widths` False: a batch holds
    one source width."""
    if decoders < 1:
      raise ValueError(f"decoders must be at least 1, got {decoders}")
    self._decode, self._rows = decode, rows
    self.max_queue, self.max_wait, self.join_requests = max_queue, max_wait, join_requests
    self.decoders, self.join_widths = decoders, join_widths
    self._queue: collections.deque[Piece] = collections.deque()
    self._cond = threading.Condition()
    self._stopping = False
    self._threads: list[threading.Thread] = []
    self._decoding = 0  # Pieces in the batches being decoded.
    self.shapes_total = 0
    self.shapes_done = 0
    self.ready = False
    self.error: BaseException | None = None  # What stopped a decoder thread, if anything.
    self._stats = Stats()

  def start(self, kinds: Sequence[tuple[int, int]]) -> None:
    """Starts the first decoder thread: it compiles every (width, beam size) of `kinds` at
    every row bucket, starts the other decoder threads, then serves."""
    shapes = [(w, k, r) for w, k in kinds for r in row_buckets(self._rows(w, k))]
    self.shapes_total = len(shapes)
    self._threads = [threading.Thread(target=self._main, args=(shapes,), name="decoder-0",
                                      daemon=True)]
    self._threads[0].start()

  def stop(self) -> None:
    """Decodes what is queued, then ends the threads (and waits for them)."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    for thread in list(self._threads):  # The first: it starts the others, or none once stopping.
      thread.join()

  def stats(self) -> Stats:
    """A copy of the decoder threads' counters."""
    with self._cond:
      return dataclasses.replace(self._stats)

  def queued(self) -> int:
    return len(self._queue)

  def submit(self, pieces: Sequence[tuple[Sequence[int], Kind]]) -> Job:
    return submit(self, pieces)

  def _append(self, pieces: list[Piece]) -> None:
    self._queue.extend(pieces)

  def _main(self, shapes=None) -> None:
    try:
      if shapes is not None:
        self._warm_up(shapes)
        with self._cond:
          if self.ready and not self._stopping:
            for i in range(1, self.decoders):
              thread = threading.Thread(target=self._main, name=f"decoder-{i}", daemon=True)
              self._threads.append(thread)
              thread.start()
      while (batch := self._next_batch()) is not None:
        self._run(batch)
    except BaseException as e:  # noqa: BLE001 -- kept for readiness; the thread must not die mute.
      logging.exception("a decoder thread stopped")
      with self._cond:
        self.error = e
        self.ready = False
        failed = [piece.job for piece in self._queue if piece.job.claim_failure()]
        self._queue.clear()
      for job in failed:
        job.future.set_exception(e)

  def _warm_up(self, shapes) -> None:
    start = time.monotonic()
    for width, beam_size, rows in shapes:
      if self._stopping:
        return
      src = np.zeros((rows, width), np.int32)
      src[:, :2] = (3, 2)  # One token then <eos>: each row ends within a few steps.
      self._decode(src, np.full(rows, width), beam_size, 0.6)
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
        batch, full = self._fill(first)
        wait = first.arrived + self.max_wait - time.monotonic()
        if not full and wait > 0 and self.join_requests and not self._stopping:
          self._cond.wait(wait)
          continue
        self._decoding += len(batch)
        taken = set(map(id, batch))
        self._queue = collections.deque(p for p in self._queue if id(p) not in taken)
        return batch

  def _fill(self, first: Piece) -> tuple[list[Piece], bool]:
    """The batch `first` heads (queued pieces it may share a batch with, its width's first,
    each in queue order, while the batch's rows allow) and whether it is full."""
    options = (first.kind.beam_size, first.kind.alpha)
    mates = [p for p in self._queue if (p.kind.beam_size, p.kind.alpha) == options
             and (self.join_requests or p.job is first.job)
             and (self.join_widths or p.kind.width == first.kind.width)]
    mates.sort(key=lambda p: p.kind.width != first.kind.width)  # Stable: queue order kept.
    share = self._share()
    limit = lambda width: (self._rows(width, first.kind.beam_size) if share is None
                           else self._bucket(width, first.kind.beam_size, share))
    batch, width = [], 0
    for piece in mates:
      wider = max(width, piece.kind.width)
      if len(batch) < limit(wider):
        batch.append(piece)
        width = wider
    return batch, len(batch) == limit(width)

  def _share(self) -> int | None:
    """With several decoders, the pieces one batch should take (None: as many as fit): the
    queued and the decoding pieces shared evenly between the decoders (a CPU decodes two
    batches of 8 faster than one of 16). Without it, one batch would take everything and
    leave the other decoders idle."""
    if self.decoders == 1:
      return None
    return max(1, -(-(len(self._queue) + self._decoding) // self.decoders))

  def _bucket(self, width: int, beam_size: int, count: int) -> int:
    """The rows a batch of `count` pieces of this width is padded to (at most the full batch)."""
    buckets = row_buckets(self._rows(width, beam_size))
    return next((r for r in buckets if r >= count), buckets[-1])

  def _run(self, batch: list[Piece]) -> None:
    kind = batch[0].kind
    width = max(p.kind.width for p in batch)
    rows = self._bucket(width, kind.beam_size, len(batch))
    src = np.zeros((rows, width), np.int32)
    for i, piece in enumerate(batch):
      src[i, :len(piece.ids)] = piece.ids
    src[len(batch):] = src[0]  # Padding rows: copies of the first (their output is dropped).
    widths = np.array([p.kind.width for p in batch] + [kind.width] * (rows - len(batch)))
    start = time.monotonic()
    try:
      tokens, scores = self._decode(src, widths, kind.beam_size, kind.alpha)
    except Exception as e:  # noqa: BLE001 -- a failed batch fails its requests, not the server.
      logging.exception("decoding a batch of %d failed", len(batch))
      with self._cond:
        self._decoding -= len(batch)
        failed = {id(p.job): p.job for p in batch if p.job.claim_failure()}
      for job in failed.values():
        job.future.set_exception(e)
      return
    done = []
    with self._cond:  # Another thread may be finishing other pieces of the same jobs.
      self._decoding -= len(batch)
      self._stats.add(len(batch), rows, time.monotonic() - start)
      for i, piece in enumerate(batch):
        if piece.job.add(piece.index, (tokens[i], scores[i])):
          done.append(piece.job)
    for job in done:
      job.future.set_result(job.results)


class SlotBatcher:
  """Batcher's interface over decoding slots (slots.py): one `SlotStream` per beam size and
  class of source widths, each driven by a thread of its own (so the classes step at once, on
  a CPU's cores as on one accelerator's queue). A request's pieces enter free slots of their
  class as soon as they come, each leaving (and its request answered, once all its pieces
  have) as soon as its search ends; no piece waits for a batch to fill or to finish.
  `stream(beam_size, width)` makes the stream of a beam size for sources of up to `width`
  tokens; `widths` are the classes' widths, ascending. A stream stops its searches every
  `max_steps` steps to take new pieces in.

  `lanes` streams (threads) serve each beam size and class at once, sharing its queue and its
  compiled programs: a CPU's matrix products on a step's few rows leave its cores partly idle,
  and a second stream stepping at the same time fills them (decoding/platforms.py). A piece goes
  to the lane holding the fewest searches, so 16 clients' sentences are split between them."""

  def __init__(self, stream: Callable[[int, int], object], widths: Sequence[int],
               max_queue: int, margin: int, max_steps: int = 4, lanes: int = 1):
    """`margin`: a piece's output limit is its width + margin (translate's rule)."""
    if lanes < 1:
      raise ValueError(f"lanes must be at least 1, got {lanes}")
    self._stream, self.widths, self.max_queue = stream, sorted(widths), max_queue
    self.margin, self.max_steps, self.lanes = margin, max_steps, lanes
    self._cond = threading.Condition()
    self._queues: dict[tuple[int, int], collections.deque[Piece]] = {}  # By (beam, class).
    self._held: dict[tuple[int, int], list[int]] = {}  # Searches each lane holds, by class.
    self._warmed: set[tuple[int, int]] = set()  # Classes whose programs are compiled.
    self._stopping = False
    self._threads: list[threading.Thread] = []
    self.shapes_total = self.shapes_done = 0
    self.ready = False
    self.error: BaseException | None = None
    self._stats = Stats()

  def start(self, kinds: Sequence[tuple[int, int]]) -> None:
    """One thread per beam size and width class of `kinds` ((width, beam size) pairs): each
    compiles its stream's programs for the widths of its class, then serves."""
    self.shapes_total = len(kinds)
    classes = sorted({(k, self._class(w)) for w, k in kinds})
    self._queues = {key: collections.deque() for key in classes}
    self._held = {key: [0] * self.lanes for key in classes}
    for k, cls in classes:
      widths = sorted(w for w, kk in kinds if kk == k and self._class(w) == cls)
      # A piece's width is the narrowest of its beam size's kinds that holds it: the class
      # holds the pieces longer than the kind below its first.
      below = max((w for w, kk in kinds if kk == k and w < widths[0]), default=0)
      lengths = range(below + 1, widths[-1] + 1)
      for lane in range(self.lanes):
        thread = threading.Thread(target=self._main, args=(k, cls, widths, lengths, lane),
                                  name=f"slots-beam{k}-width{cls}-lane{lane}", daemon=True)
        self._threads.append(thread)
    for thread in self._threads:
      thread.start()

  def stop(self) -> None:
    """Decodes what is queued, then ends the threads (and waits for them)."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    for thread in self._threads:
      thread.join()

  def stats(self) -> Stats:
    with self._cond:
      return dataclasses.replace(self._stats)

  def queued(self) -> int:
    return sum(map(len, self._queues.values()))

  def submit(self, pieces: Sequence[tuple[Sequence[int], Kind]]) -> Job:
    return submit(self, pieces)

  def _append(self, pieces: list[Piece]) -> None:
    for piece in pieces:
      self._queues[piece.kind.beam_size, self._class(piece.kind.width)].append(piece)

  def _class(self, width: int) -> int:
    return next(w for w in self.widths if width <= w)

  def _main(self, beam_size: int, width: int, widths: list[int], lengths: range,
            lane: int) -> None:
    key = (beam_size, width)
    queue, held, pieces, number = self._queues[key], self._held[key], {}, 0
    try:
      stream = self._stream(beam_size, width)
      if lane == 0:
        self._warm_up(stream, widths, lengths, key)
      else:  # The lanes share the class's programs: the first compiles them.
        with self._cond:
          while key not in self._warmed and self.error is None and not self._stopping:
            self._cond.wait()
      slots = stream.decoder.slots
      while True:
        with self._cond:
          held[lane] = stream.running + stream.waiting
          # A lane takes pieces while it holds the fewest searches of the class's lanes.
          mine = lambda: queue and held[lane] < slots and held[lane] <= min(held)
          while not mine() and not stream.busy and not self._stopping:
            self._cond.wait()
          if not mine() and not stream.busy:
            return  # Stopping, and nothing is left for this lane.
          # Pieces wait here (counted against max_queue) until a slot is free.
          while mine():
            piece = queue.popleft()
            number += 1
            pieces[number] = piece
            stream.put(number, np.asarray(piece.ids, np.int32),
                       piece.kind.width + self.margin, piece.kind.alpha)
            held[lane] += 1
        start = time.monotonic()
        # Every piece put has a slot: the run ends as soon as a search ends (its answer is
        # due), or after max_steps.
        finished = stream.advance(min_free=slots - stream.running - stream.waiting + 1,
                                  max_steps=self.max_steps)
        if finished:
          self._finish(pieces, finished, time.monotonic() - start,
                       stream.running + len(finished))
    except BaseException as e:  # noqa: BLE001 -- kept for readiness; the thread must not die mute.
      logging.exception("a decoder thread stopped")
      with self._cond:
        self.error = e
        self.ready = False
        jobs = [p.job for p in [*pieces.values(), *queue] if p.job.claim_failure()]
        queue.clear()
        self._cond.notify_all()
      for job in jobs:
        job.future.set_exception(e)

  def _warm_up(self, stream, widths: list[int], lengths: range,
               key: tuple[int, int]) -> None:
    """Compiles (or loads) the stream's programs before serving, and calls those traffic
    meets first (SlotStream.warm_up): every run size, and the encoder's for the batches that
    pieces of `lengths` tokens make (encoded in the decoder's width for their longest)."""
    start = time.monotonic()
    stream.warm_up(sorted({stream.decoder.encode_width(n) for n in lengths}))
    logging.info("compiled the slots of %d widths in %.1f s", len(widths),
                 time.monotonic() - start)
    with self._cond:
      self.shapes_done += len(widths)
      self._warmed.add(key)
      self.ready = len(self._warmed) == len(self._queues)
      self._cond.notify_all()

  def _finish(self, pieces: dict, finished, seconds: float, rows: int) -> None:
    """Answers the pieces that `finished` (a run that held `rows` searches, in `seconds`)."""
    done = []
    with self._cond:
      self._stats.add(len(finished), rows, seconds)
      for number, tokens, scores in finished:
        piece = pieces.pop(number)
        if piece.job.add(piece.index, (tokens, scores)):
          done.append(piece.job)
    for job in done:
      job.future.set_result(job.results)
