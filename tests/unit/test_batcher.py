"""The server's slot batcher with a counting model: ready once what one sentence needs is
compiled, the rest compiled while it serves; the bounded queue; a compile that fails."""

import threading
import time

import jax.numpy as jnp
import pytest

from transformer_jax.decoding import slots, streams
from transformer_jax.decoding.generation import SPECIALS
from transformer_jax.programs import ProgramStore
from transformer_jax.serving.batcher import Kind, NotReady, QueueFull, SlotBatcher

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


def _counting_model():
  """Output for a source of n tokens: 5, 6, ..., then <eos> at step n - 1."""
  def encode(params, src, width):
    return {"n": jnp.sum(src != SPECIALS.pad, axis=1)}

  def step(params, tokens, cache, sources, index):
    n = jnp.repeat(sources["n"], tokens.shape[0] // sources["n"].shape[0])
    best = jnp.where(index + 1 >= n, SPECIALS.eos, 5 + index)
    return jnp.where(jnp.arange(32)[None, :] == best[:, None], 0.0, -5.0), cache

  return slots.SlotModel(step=step, encode=encode, init_cache=lambda params, rows, max_len: {
      "calls": jnp.zeros((rows,), jnp.int32)})


def _piece(n, beam=1):
  return [7] * (n - 1) + [SPECIALS.eos], Kind(-(-n // 8) * 8, beam, 0.6)


def _batcher(release: threading.Event, lanes=1, max_queue=64, broken=False):
  """Classes of 8 and 16 tokens, beams 1 and 2; each class's whole warm-up (SlotStream.warm_up)
  waits for `release`."""
  store = ProgramStore(None)

  def stream(beam_size, width):
    decoder = slots.SlotDecoder(_counting_model(), None, 4, width, width + 10, SPECIALS,
                                beam_size=beam_size, programs=store)
    made = streams.SlotStream(decoder)
    if broken:
      made.warm_one = lambda widths: (_ for _ in ()).throw(ValueError("no such shape"))
    whole = made.warm_up
    made.warm_up = lambda widths, stopping: (release.wait(60), whole(widths, stopping))
    return made

  batcher = SlotBatcher(stream, [8, 16], max_queue=max_queue, margin=10, lanes=lanes)
  batcher.start([(8, 1), (16, 1), (8, 2), (16, 2)], first_beam=2)
  return batcher, store


def _wait(condition, batcher):
  start = time.monotonic()
  while not condition():
    assert time.monotonic() - start < 60, "timed out"
    time.sleep(0.01)


def test_ready_before_every_program_is_compiled_and_every_request_is_answered():
  release = threading.Event()
  batcher, store = _batcher(release)
  _wait(lambda: batcher.ready or batcher.error, batcher)
  assert batcher.error is None
  assert batcher.ready and batcher.shapes_done == 0 and batcher.shapes_total == 4
  at_ready = store.compiled
  # Every length at both beam sizes, several at once: some meet programs (encoder batches of
  # several rows, larger runs) that only the held warm-up would have made: compiled on demand.
  jobs = [(n, batcher.submit([_piece(n, beam), _piece(max(1, n - 1), beam)]))
          for n in range(1, 17) for beam in (1, 2)]
  for n, job in jobs:
    (first, _), (second, _) = job.future.result(timeout=60)
    assert first[0][:n].tolist() == [5 + i for i in range(n - 1)] + [SPECIALS.eos]
    assert second[0][:max(1, n - 1)].tolist()[-1] == SPECIALS.eos
  assert store.compiled > at_ready
  release.set()
  _wait(lambda: batcher.shapes_done == batcher.shapes_total, batcher)
  batcher.stop()
  assert batcher.error is None


def test_a_full_queue_refuses_a_request_whole_and_stopping_answers_the_queued_ones():
  release = threading.Event()
  batcher, _ = _batcher(release, max_queue=3)
  _wait(lambda: batcher.ready, batcher)
  with batcher._cond:  # The lanes wait for the lock: nothing leaves the queue meanwhile.
    first = batcher.submit([_piece(5), _piece(6)])
    with pytest.raises(QueueFull, match="2 sentences are waiting and this request brings 2"):
      batcher.submit([_piece(3), _piece(4)])
    assert batcher.queued() == 2
  release.set()
  batcher.stop()
  assert [len(tokens[0]) > 0 for tokens, _ in first.future.result(0)] == [True, True]
  with pytest.raises(NotReady, match="stopping"):
    batcher.submit([_piece(4)])


def test_a_compile_that_fails_leaves_the_server_unready_with_the_reason():
  batcher, _ = _batcher(threading.Event(), broken=True)
  _wait(lambda: batcher.error is not None, batcher)
  assert not batcher.ready and isinstance(batcher.error, ValueError)
  with pytest.raises(NotReady, match="the decoder stopped"):
    batcher.submit([_piece(4)])
  batcher.stop()


def test_the_held_back_stop_prefix_is_the_longest_end_that_begins_a_stop_string():
  """Against the definition itself, on texts and stop strings of a small alphabet (where
  ends and beginnings overlap most)."""
  import random
  from transformer_jax.serving.openai_requests import _stop_prefix
  rng = random.Random(0)
  word = lambda n: "".join(rng.choice("ab\u00e9") for _ in range(n))
  for _ in range(3000):
    text, stops = word(rng.randint(0, 12)), [word(rng.randint(1, 6)) for _ in range(rng.randint(1, 4))]
    naive = max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])] or [0])
    assert _stop_prefix(text, stops) == naive, (text, stops)
