"""The batcher with a fake decoder that records every batch: which sentences are joined, how
batches are padded, the bounded queue, draining on stop."""

import threading
import time

import numpy as np
import pytest

from transformer_jax.batcher import Batcher, Kind, NotReady, QueueFull, row_buckets

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


class FakeDecoder:
  """Output row i = the source row, so answers can be traced back; records each batch's shape
  and holds every batch until `release` is set (after warm-up)."""

  def __init__(self):
    self.batches = []
    self.release = threading.Event()
    self.warm = True

  def __call__(self, src, beam_size, alpha):
    if not self.warm:
      self.release.wait(30)
      self.batches.append((src.shape, beam_size, alpha, src[:, 0].tolist()))
    tokens = np.repeat(src[:, None, :], beam_size, axis=1)  # [R, K, W]
    scores = np.tile(-np.arange(beam_size, dtype=np.float32), (len(src), 1))
    return tokens, scores


def _batcher(decoder, join=True, max_queue=64, max_wait=0.0):
  batcher = Batcher(decoder, lambda width, beam: 64 // (width * beam) or 1, max_queue, max_wait,
                    join_requests=join)
  batcher.start([(8, 1), (16, 1), (8, 2)])
  while not batcher.ready:
    assert batcher.error is None
    time.sleep(0.01)
  decoder.warm = False
  return batcher


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
  busy = batcher.submit([_piece(99, beam=2)])  # Holds the decoder while the others queue.
  while batcher.queued():
    time.sleep(0.01)
  jobs = [batcher.submit([_piece(10 + i)]) for i in range(3)]
  other = batcher.submit([_piece(20, width=16), _piece(21)])
  decoder.release.set()
  results = [job.future.result(30) for job in [busy, *jobs, other]]
  batcher.stop()
  # After the one that held the decoder: the oldest's kind, all four of width 8 and beam 1
  # together (4 rows: a bucket), then the width-16 one alone.
  assert decoder.batches == [((1, 8), 2, 0.6, [99]), ((4, 8), 1, 0.6, [10, 11, 12, 21]),
                             ((1, 16), 1, 0.6, [20])]
  # Every piece gets its own row's output back, in its request's order.
  assert [r[0][0][0][0] for r in results[1:4]] == [10, 11, 12]
  assert [row[0][0][0] for row in results[4]] == [20, 21]


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

  def flaky(src, beam_size, alpha):
    calls.append(src[0, 0])
    if len(calls) == 1:
      raise RuntimeError("out of memory")
    return decoder(src, beam_size, alpha)

  batcher._decode = flaky
  decoder.release.set()
  failed = batcher.submit([_piece(60)])
  with pytest.raises(RuntimeError, match="out of memory"):
    failed.future.result(30)
  assert batcher.submit([_piece(61)]).future.result(30)[0][0][0][0] == 61
  batcher.stop()


def test_a_decoder_that_cannot_compile_leaves_the_server_unready_with_the_reason():
  def broken(src, beam_size, alpha):
    raise ValueError("no such shape")

  batcher = Batcher(broken, lambda width, beam: 4, 8, 0.0)
  batcher.start([(8, 1)])
  batcher._thread.join(30)
  assert not batcher.ready and isinstance(batcher.error, ValueError)
  with pytest.raises(NotReady, match="the decoder stopped"):
    batcher.submit([_piece(70)])
