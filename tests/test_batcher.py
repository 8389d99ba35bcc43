"""The batcher with a fake decoder that records every batch: which sentences are joined, how
batches are padded, the bounded queue, draining on stop."""

import threading
import time

import numpy as np
import pytest

from transformer_jax.serving.batcher import Batcher, Kind, NotReady, QueueFull, row_buckets

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


class FakeDecoder:
  """Output row i = the source row, so answers can be traced back; records each batch's shape
  and holds every batch until `release` is set (after warm-up)."""

  def __init__(self):
    self.batches = []
    self.widths = []  # Each batch's rows' own widths.
    self.release = threading.Event()
    self.warm = True

  def __call__(self, src, widths, beam_size, alpha):
    if not self.warm:
      self.release.wait(30)
      self.batches.append((src.shape, beam_size, alpha, src[:, 0].tolist()))
      self.widths.append(widths.tolist())
    tokens = np.repeat(src[:, None, :], beam_size, axis=1)  # [R, K, W]
    scores = np.tile(-np.arange(beam_size, dtype=np.float32), (len(src), 1))
    return tokens, scores


def _batcher(decoder, join=True, max_queue=64, max_wait=0.0, decoders=1, join_widths=True):
  batcher = Batcher(decoder, lambda width, beam: 64 // (width * beam) or 1, max_queue, max_wait,
                    join_requests=join, decoders=decoders, join_widths=join_widths)
  batcher.start([(8, 1), (16, 1), (8, 2)])
  while not batcher.ready:
    assert batcher.error is None
    time.sleep(0.01)
  decoder.warm = False
  return batcher


def _hold(batcher):
  """A job that holds the (fake) decoder, taken from the queue: the next ones queue up."""
  busy = batcher.submit([_piece(99, beam=2)])
  while batcher.queued():
    time.sleep(0.01)
  return busy


def _piece(first, width=8, beam=1):
  return [first, 2], Kind(width, beam, 0.6)


def test_row_buckets_double_up_to_the_full_batch():
  assert row_buckets(1) == (1,)
  assert row_buckets(8) == (1, 2, 4, 8)
  assert row_buckets(42) == (1, 2, 4, 8, 16, 32, 42)


def test_every_shape_is_compiled_before_the_first_request():
  decoder = FakeDecoder()
  batcher = Batcher(decoder, lambda width, beam: 64 // (width * beam), 8, 0.0)
  with pytest.raises(NotReady, match="compiling"):
    batcher.submit([_piece(5)])
  decoder.warm = True
  batcher.start([(8, 1), (16, 1)])
  while not batcher.ready:
    time.sleep(0.01)
  # Rows 1..8 for width 8 (8 rows at most), 1..4 for width 16.
  assert batcher.shapes_done == batcher.shapes_total == 4 + 3
  batcher.stop()


def test_waiting_requests_of_a_kind_are_decoded_together_and_padded_to_a_bucket():
  decoder = FakeDecoder()
  batcher = _batcher(decoder)
  busy = _hold(batcher)
  jobs = [batcher.submit([_piece(10 + i)]) for i in range(3)]
  other = batcher.submit([_piece(20, width=16), _piece(21)])
  decoder.release.set()
  results = [job.future.result(30) for job in [busy, *jobs, other]]
  batcher.stop()
  # After the one that held the decoder: the oldest's kind, all four of width 8 and beam 1
  # together (4 rows: a bucket), then the width-16 one alone (a batch of width 16 holds 4
  # rows: it did not fit).
  assert decoder.batches == [((1, 8), 2, 0.6, [99]), ((4, 8), 1, 0.6, [10, 11, 12, 21]),
                             ((1, 16), 1, 0.6, [20])]
  # Every piece gets its own row's output back, in its request's order.
  assert [r[0][0][0][0] for r in results[1:4]] == [10, 11, 12]
  assert [row[0][0][0] for row in results[4]] == [20, 21]


def test_pieces_of_other_widths_fill_a_batch_after_those_of_its_own_width():
  decoder = FakeDecoder()
  batcher = _batcher(decoder)
  busy = _hold(batcher)
  # Width 8 holds 8 rows, width 16 holds 4: the first three (width 8, 16, 8) fit a batch of
  # width 16, the fourth (width 16) would make it 5 rows.
  jobs = [batcher.submit([_piece(10, width=8)]), batcher.submit([_piece(11, width=16)]),
          batcher.submit([_piece(12, width=8)]), batcher.submit([_piece(13, width=16)]),
          batcher.submit([_piece(14, width=8)])]
  decoder.release.set()
  results = [job.future.result(30) for job in [busy, *jobs]]
  batcher.stop()
  # Its own width's pieces first (10, 12, 14), then the width-16 one that fits; each row
  # decoded with its own width (the padding row copies the first's).
  assert decoder.batches[1:] == [((4, 16), 1, 0.6, [10, 12, 14, 11]), ((1, 16), 1, 0.6, [13])]
  assert decoder.widths[1:] == [[8, 8, 8, 16], [16]]
  assert [r[0][0][0][0] for r in results[1:]] == [10, 11, 12, 13, 14]


def test_without_joining_widths_a_batch_holds_one_width():
  decoder = FakeDecoder()
  batcher = _batcher(decoder, join_widths=False)
  job = batcher.submit([_piece(20, width=8), _piece(21, width=16), _piece(22, width=8)])
  decoder.release.set()
  job.future.result(30)
  batcher.stop()
  assert [b[3] for b in decoder.batches] == [[20, 22], [21]]


def test_several_decoders_decode_batches_at_once_and_share_the_queue():
  decoder = FakeDecoder()
  both = threading.Barrier(2, timeout=30)  # Passed only when two batches decode at once.
  shapes = []

  def together(src, widths, beam_size, alpha):
    if not decoder.warm:
      shapes.append(src[:, 0].tolist())
      both.wait()
    return decoder(src, widths, beam_size, alpha)

  batcher = _batcher(decoder, decoders=2)
  batcher._decode = together
  decoder.release.set()
  # Eight queued pieces at once: the first decoder takes its share, 4 (half of the queued
  # and decoding pieces), the second the other 4; both batches then meet at the barrier.
  with batcher._cond:  # Queued before either decoder can look.
    jobs = [batcher.submit([_piece(30 + i)]) for i in range(8)]
  results = [job.future.result(30) for job in jobs]
  batcher.stop()
  assert sorted(shapes) == [[30, 31, 32, 33], [34, 35, 36, 37]]
  assert [r[0][0][0][0] for r in results] == list(range(30, 38))
  assert batcher.stats().batches == 2 and batcher.stats().sentences == 8


def test_stopping_with_two_decoders_busy_answers_every_queued_request():
  decoder = FakeDecoder()
  batcher = _batcher(decoder, decoders=2)
  with batcher._cond:  # Four pieces: each decoder takes two and holds them in the decoder.
    held = [batcher.submit([_piece(40 + i)]) for i in range(4)]
  while batcher.queued():
    time.sleep(0.01)
  waiting = [batcher.submit([_piece(50 + i)]) for i in range(3)]
  stopper = threading.Thread(target=batcher.stop)
  stopper.start()  # Stopping while both decode and three wait ...
  while not batcher._stopping:
    time.sleep(0.01)
  with pytest.raises(NotReady, match="stopping"):
    batcher.submit([_piece(60)])
  decoder.release.set()
  stopper.join(30)
  assert not stopper.is_alive()  # ... ends only once every accepted piece is answered.
  assert [job.future.result(0)[0][0][0][0] for job in held + waiting] == [40, 41, 42, 43,
                                                                          50, 51, 52]


def test_a_batch_of_3_is_padded_to_4_rows_with_copies_of_its_first():
  decoder = FakeDecoder()
  batcher = _batcher(decoder)
  job = batcher.submit([_piece(30), _piece(31), _piece(32)])
  decoder.release.set()
  job.future.result(30)
  batcher.stop()
  assert decoder.batches == [((4, 8), 1, 0.6, [30, 31, 32, 30])]


def test_without_joining_each_request_is_a_batch_of_its_own():
  decoder = FakeDecoder()
  batcher = _batcher(decoder, join=False)
  jobs = [batcher.submit([_piece(40 + i)]) for i in range(3)]
  decoder.release.set()
  for job in jobs:
    job.future.result(30)
  batcher.stop()
  assert [b[3] for b in decoder.batches] == [[40], [41], [42]]


def test_a_full_queue_refuses_a_request_whole_and_keeps_the_queued_ones():
  decoder = FakeDecoder()
  batcher = _batcher(decoder, max_queue=3, max_wait=60.0)  # Nothing leaves the queue early.
  first = batcher.submit([_piece(50), _piece(51)])
  with pytest.raises(QueueFull, match="2 sentences are waiting and this request brings 2"):
    batcher.submit([_piece(52), _piece(53)])
  assert batcher.queued() == 2
  decoder.release.set()
  batcher.stop()  # Stopping ends the wait: what is queued is decoded, then the thread ends.
  assert [row[0][0][0] for row in first.future.result(0)] == [50, 51]
  with pytest.raises(NotReady, match="stopping"):
    batcher.submit([_piece(54)])


def test_a_failed_batch_fails_its_requests_and_the_next_batch_still_runs():
  decoder = FakeDecoder()
  batcher = _batcher(decoder)
  calls = []

  def flaky(src, widths, beam_size, alpha):
    calls.append(src[0, 0])
    if len(calls) == 1:
      raise RuntimeError("out of memory")
    return decoder(src, widths, beam_size, alpha)

  batcher._decode = flaky
  decoder.release.set()
  failed = batcher.submit([_piece(60)])
  with pytest.raises(RuntimeError, match="out of memory"):
    failed.future.result(30)
  assert batcher.submit([_piece(61)]).future.result(30)[0][0][0][0] == 61
  batcher.stop()


def test_a_decoder_that_cannot_compile_leaves_the_server_unready_with_the_reason():
  def broken(src, widths, beam_size, alpha):
    raise ValueError("no such shape")

  batcher = Batcher(broken, lambda width, beam: 4, 8, 0.0)
  batcher.start([(8, 1)])
  batcher._threads[0].join(30)
  assert not batcher.ready and isinstance(batcher.error, ValueError)
  with pytest.raises(NotReady, match="the decoder stopped"):
    batcher.submit([_piece(70)])
