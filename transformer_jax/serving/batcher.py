"""Continuous batching for serving: the sentences of concurrent requests decoded together in
decoding slots (decoding/slots.py), which each enters as it comes and leaves as its search ends.

Requests hand in sentences as token ids (a `Piece` each), queued by beam size and class of
source widths; a thread per lane of each class puts them into free slots between two decoder
steps and answers a request once its last piece is decoded. One more thread compiles the
programs: first what one piece of each width needs (then the server is ready), then the rest
while serving; a piece that meets a program not made yet waits for it, it is not refused. The
queue holds at most `max_queue` pieces: a request that would overflow it is refused whole
(`QueueFull`), so memory stays bounded.

Nothing here knows the model or HTTP: `stream(beam_size, width)` is the caller's, a
streams.SlotStream over the slots of that beam size and class.
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


class QueueFull(Exception):
  """The queue has no room for a request's sentences."""


class NotReady(Exception):
  """The decoder is still compiling its shapes, or is stopping."""


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


class SlotBatcher:
  """The server's decoder over decoding slots (slots.py): one `SlotStream` per beam size and
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
    self._stopping = False
    self._threads: list[threading.Thread] = []
    # Streams are made one at a time: the lanes and the compiling thread of a class share its
    # decoder, which the first of them makes (the caller's `stream` may make one per call).
    self._making = threading.Lock()
    self.shapes_total = self.shapes_done = 0
    self.ready = False
    self.error: BaseException | None = None
    self._stats = Stats()

  def _new_stream(self, beam_size: int, width: int):
    with self._making:
      return self._stream(beam_size, width)

  def start(self, kinds: Sequence[tuple[int, int]], first_beam: int | None = None) -> None:
    """`lanes` threads per beam size and width class of `kinds` ((width, beam size) pairs),
    serving at once, and one that compiles the classes' programs (`_warm_all`): ready once
    those one sentence needs are compiled, `first_beam`'s first; the rest while serving."""
    classes = sorted({(k, self._class(w)) for w, k in kinds})
    self.shapes_total = len(classes)
    self._queues = {key: collections.deque() for key in classes}
    self._held = {key: [0] * self.lanes for key in classes}
    plan = {}
    for k, cls in classes:
      widths = sorted(w for w, kk in kinds if kk == k and self._class(w) == cls)
      # A piece's width is the narrowest of its beam size's kinds that holds it: the class
      # holds the pieces longer than the kind below its first.
      below = max((w for w, kk in kinds if kk == k and w < widths[0]), default=0)
      plan[k, cls] = range(below + 1, widths[-1] + 1)
      for lane in range(self.lanes):
        self._threads.append(threading.Thread(
            target=self._main, args=(k, cls, lane), name=f"slots-beam{k}-width{cls}-lane{lane}",
            daemon=True))
    order = sorted(plan, key=lambda key: (key[0] != first_beam, key))
    self._threads.append(threading.Thread(target=self._warm_all, args=(plan, order),
                                          name="slots-compile", daemon=True))
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
    """Queues one request's pieces (ids with <eos>, kind); raises QueueFull or NotReady."""
    job = Job(len(pieces))
    with self._cond:
      if self.error is not None:
        raise NotReady(f"the decoder stopped ({self.error!r}); restart the server")
      if not self.ready or self._stopping:
        raise NotReady("stopping" if self._stopping else
                       "compiling what one sentence needs (GET /ready says when done)")
      queued = self.queued()
      if queued + len(pieces) > self.max_queue:
        raise QueueFull(f"{queued} sentences are waiting and this request brings {len(pieces)} "
                        "(a line cut at its sentence ends brings one a sentence); the queue holds "
                        f"{self.max_queue} (--max_queue)")
      self._append([Piece(job, i, ids, kind) for i, (ids, kind) in enumerate(pieces)])
      self._cond.notify_all()
    return job

  def _append(self, pieces: list[Piece]) -> None:
    for piece in pieces:
      self._queues[piece.kind.beam_size, self._class(piece.kind.width)].append(piece)

  def _class(self, width: int) -> int:
    return next(w for w in self.widths if width <= w)

  def _main(self, beam_size: int, width: int, lane: int) -> None:
    key = (beam_size, width)
    queue, held, pieces, number = self._queues[key], self._held[key], {}, 0
    try:
      # A program that traffic meets before the compiling thread made it is compiled (or
      # loaded) by the call that needs it; the thread's, if under way, is waited for.
      stream = self._new_stream(beam_size, width)
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
      self._fail(e, list(pieces.values()), [queue])

  def _warm_all(self, plan: dict[tuple[int, int], range], order: list[tuple[int, int]]) -> None:
    """Compiles (or loads) the programs of every class of `plan` ((beam size, class width) ->
    the source lengths its pieces have), in `order`, on streams of its own (the lanes' stay
    free for traffic): first what one piece of each encoder width needs (its encoder for one
    row, a refill, the smallest run; SlotStream.warm_one), then ready; then each class's every
    program (SlotStream.warm_up), counted in shapes_done."""
    start = time.monotonic()
    try:
      warming = {}
      for key in order:
        if self._stopping:
          return
        warming[key] = stream = self._new_stream(*key)
        stream.warm_one(self._encode_widths(stream, plan[key]))
      logging.info("compiled what one sentence of each width needs in %.1f s; ready (the other "
                   "programs compile while serving)", time.monotonic() - start)
      with self._cond:
        self.ready = True
        self._cond.notify_all()
      for key in order:
        if self._stopping:
          return
        stream = warming[key]
        stream.warm_up(self._encode_widths(stream, plan[key]), lambda: self._stopping)
        if self._stopping:
          return
        with self._cond:
          self.shapes_done += 1
      logging.info("compiled every decoder program in %.1f s", time.monotonic() - start)
    except BaseException as e:  # noqa: BLE001 -- kept for readiness; the thread must not die mute.
      logging.exception("compiling the decoder's programs failed")
      self._fail(e, [], list(self._queues.values()))

  def _fail(self, error: BaseException, pieces: list[Piece],
            queues: list[collections.deque]) -> None:
    """After `error` stopped a thread: the server unready (GET /health says why), and the
    requests of `pieces` (a lane's in its slots) and of the pieces waiting in `queues` failed
    with it."""
    with self._cond:
      self.error = error
      self.ready = False
      jobs = [p.job for p in [*pieces, *(p for queue in queues for p in queue)]
              if p.job.claim_failure()]
      for queue in queues:
        queue.clear()
      self._cond.notify_all()
    for job in jobs:
      job.future.set_exception(error)

  @staticmethod
  def _encode_widths(stream, lengths: range) -> list[int]:
    """The encoder widths that pieces of `lengths` tokens are encoded in by `stream`."""
    return sorted({stream.decoder.encode_width(n) for n in lengths})

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
