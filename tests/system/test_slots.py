"""Decoding slots against the batch decoders, on the trained smoke model: the same tokens and
scores for every sentence, with sentences of many lengths entering and leaving few slots."""

import collections
import dataclasses
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decoding import generation, platforms, search, slots, streams
from transformer_jax.decoding.generation import SPECIALS, encode_sources
from transformer_jax.decoding.options import DecodeOptions
from transformer_jax.programs import ProgramStore
from transformer_jax.decoding.inputs import split_pairs
from transformer_jax.decoding.lines import translate_lines
from transformer_jax.decoding.translator import Translator


@pytest.fixture(scope="module")
def translator(trained):
  return Translator(trained[1])


@pytest.fixture(scope="module")
def sources(trained):
  """40 sources from 2 to about 50 tokens, in no order of length: validation sentences, some
  joined in twos and threes (the smoke model's outputs run to their limits, which follow the
  widths: sentences then leave the slots at many steps)."""
  texts, _ = split_pairs(str(trained[1]), "validation")
  texts = texts[::len(texts) // 120][:120]  # The split runs from short to long sentences.
  return [" ".join(texts[3 * j:3 * j + 1 + j % 3]) for j in range(40)]


def _rows(translator, texts):
  src = encode_sources(translator.tokenizers.src, texts, translator.max_src_len)
  return src, [row[row != 0] for row in src]


@pytest.mark.parametrize("beam_size,beam_stop", [(1, "first_k"), (4, "first_k"), (4, "exact")])
def test_slots_give_each_sentence_what_a_batch_of_its_width_gives(translator, sources,
                                                                  beam_size, beam_stop):
  options = DecodeOptions(beam_size=beam_size, alpha=0.6, beam_stop=beam_stop)
  src, rows = _rows(translator, sources)
  widths = np.array([-(-len(r) // 8) * 8 for r in rows])
  tokens, scores = translator.decode(src, options, widths=widths)
  got = translator.decode_slots(rows, options, num_slots=3)
  ends = set()
  for i, (slot_tokens, slot_scores) in enumerate(got):
    # The arrays' lengths are the decoders' (each its widest source + 10); past an output's
    # own limit both hold <pad>.
    n = min(slot_tokens.shape[1], tokens.shape[2])
    np.testing.assert_array_equal(slot_tokens[:, :n], tokens[i, :, :n], err_msg=str(i))
    assert (slot_tokens[:, n:] == SPECIALS.pad).all() and (tokens[i, :, n:] == SPECIALS.pad).all()
    np.testing.assert_allclose(slot_scores, scores[i], rtol=1e-5, atol=1e-5)
    ends.add(int((tokens[i, 0] != SPECIALS.pad).sum()))
  assert len(ends) >= 4  # Outputs of many lengths: sentences left the slots at many steps.


@pytest.mark.parametrize("beam_size", [1, 4])
def test_an_accelerators_slot_settings_give_what_the_batch_decoder_gives(trained, sources,
                                                                         beam_size):
  """A GPU's settings, run here on the CPU: one width class (the model's max_len) and one run
  size, so short and long sources share the slots and every step steps all of them; beams'
  cache rows and new sources copied by gathers."""
  gpu = Translator(trained[1], platform="gpu")
  assert gpu.slot_widths == [gpu.slot_widths[-1]] and gpu.lanes == 1
  assert gpu.row_copy == "gather"  # Beams' cache rows and new sources: one gather each.
  options = DecodeOptions(beam_size=beam_size, alpha=0.6)
  src, rows = _rows(gpu, sources)
  widths = np.array([-(-len(r) // 8) * 8 for r in rows])
  tokens, scores = gpu.decode(src, options, widths=widths)
  got = gpu.decode_slots(rows, options, num_slots=5)
  (decoder,) = gpu._slot_decoders.values()
  assert decoder.run_sizes == [5] and decoder.width == gpu.slot_widths[-1]
  assert decoder.row_copy == "gather"
  for i, (slot_tokens, slot_scores) in enumerate(got):
    n = min(slot_tokens.shape[1], tokens.shape[2])
    np.testing.assert_array_equal(slot_tokens[:, :n], tokens[i, :, :n], err_msg=str(i))
    np.testing.assert_allclose(slot_scores, scores[i], rtol=1e-5, atol=1e-5)


def test_sampling_in_slots_draws_what_the_batch_sampler_draws(translator, sources):
  """With a fixed key, each sentence samples the same tokens in a batch and in slots (its
  keys come from its number in the input and the step)."""
  src, rows = _rows(translator, sources[:16])
  width, max_len = src.shape[1], src.shape[1] + 10
  sampler, rng = search.Sampling(temperature=1.5, top_k=20), jax.random.PRNGKey(7)
  step, cache = generation.decoder(translator.model, translator.params, src, max_len)
  batch = np.asarray(jax.jit(lambda: search.sample_scored(
      step, cache, len(rows), max_len, SPECIALS, sampler, rng)[0])())
  decoder = slots.SlotDecoder(generation.slot_model(translator.model), translator.params, 5,
                              width, max_len, SPECIALS, sampler=sampler, rng=rng)
  got = streams.decode_all(decoder, rows, [max_len] * len(rows))
  for i, (tokens, _) in enumerate(got):
    np.testing.assert_array_equal(tokens[0], batch[i], err_msg=str(i))
  greedy = generation.translate_ids(translator.model, translator.params, src, max_len)
  assert not np.array_equal(np.asarray(greedy), batch)  # It did sample.


def test_translate_lines_in_slots_equals_batches(translator, sources):
  lines = sources[:24] + ["", sources[0]]
  options = DecodeOptions(beam_size=4, alpha=0.6)
  batched = translate_lines(translator, lines, options, batch_size=8, progress=False,
                            segment_over=None)
  assert translate_lines(translator, lines, options, batch_size=8, progress=False,
                         segment_over=None, num_slots=4) == batched
  assert batched[24] == "" and batched[25] == batched[0]


def _counting_model(vocab=16):
  """A SlotModel whose output for a source of n tokens is 5, 6, ..., then <eos> at step n - 1
  (one step per source token): sentences of different lengths end at different steps."""
  def encode(params, src, width):
    return {"n": jnp.sum(src != SPECIALS.pad, axis=1)}

  def step(params, tokens, cache, sources, index):
    n = jnp.repeat(sources["n"], tokens.shape[0] // sources["n"].shape[0])  # A beam's rows.
    best = jnp.where(index + 1 >= n, SPECIALS.eos, 5 + index)
    logits = jnp.where(jnp.arange(vocab)[None, :] == best[:, None], 0.0, -5.0)
    return logits, {"calls": cache["calls"] + 1}

  return slots.SlotModel(step=step, init_cache=lambda params, rows, max_len: {
      "calls": jnp.zeros((rows,), jnp.int32)}, encode=encode)


def _wait_compiled(batcher):
  """Until the batcher's compiling thread has made every class's programs."""
  while batcher.shapes_done < batcher.shapes_total:
    assert batcher.error is None
    time.sleep(0.01)
  assert batcher.ready


def _watched(program, watch):
  """`program` (a ProgramStore function), calling watch(out) with each call's output."""
  def call(*args):
    out = program(*args)
    watch(out)
    return out
  call.compile = program.compile
  return call


@pytest.mark.quick
def test_sources_are_encoded_in_the_fewest_rows_that_hold_them():
  """A file's last sources, and a server's few new ones, are encoded in a batch of an eighth,
  a quarter or a half of the slots where one fits (on a CPU; an accelerator has the eighth and
  all of them), not in one of every slot."""
  assert slots.encode_sizes(128) == [1, 2, 16, 32, 64, 128]
  assert slots.encode_sizes(32) == [1, 2, 4, 8, 16, 32]
  assert slots.encode_sizes(128, fraction=1) == [16, 128]
  assert slots.encode_sizes(4) == [1, 2, 4]
  lengths = [3 + i % 5 for i in range(16 + 7)]  # A batch of every slot, then 7 sources.
  sources = [np.array([7] * (n - 1) + [SPECIALS.eos], np.int32) for n in lengths]
  decoder = slots.SlotDecoder(_counting_model(), None, 16, 8, 12, SPECIALS)
  shapes, encode = [], decoder._encode
  decoder._encode = lambda params, src: (shapes.append(src.shape), encode(params, src))[1]
  results = streams.decode_all(decoder, sources, [12] * len(sources))
  # Each batch as wide as its longest source rounded up to 4: the last 7 hold 3 or 4 tokens.
  assert shapes == [(16, 8), (8, 4)]
  # An accelerator's settings round up to 8 (fewer programs), and none is over the width.
  wide = lambda fraction: slots.SlotDecoder(_counting_model(), None, 16, 32, 40, SPECIALS,
                                            min_rows_fraction=fraction)
  assert [wide(16).encode_width(n) for n in (1, 4, 5, 9, 31)] == [4, 4, 8, 12, 32]
  assert [wide(1).encode_width(n) for n in (1, 4, 5, 9, 31)] == [8, 8, 8, 16, 32]
  for n, (tokens, _) in zip(lengths, results):
    assert tokens[0][:n].tolist() == [5 + i for i in range(n - 1)] + [SPECIALS.eos]


@pytest.mark.quick
def test_a_batch_of_many_source_tokens_is_encoded_a_chunk_of_rows_at_a_time():
  """A CPU's encoder program computes at most encode_tokens source tokens at once (the most
  rows dividing the batch that hold them, at least one); an accelerator's a batch whole."""
  assert slots.chunk_rows(128, 16, 1024) == 64
  assert slots.chunk_rows(128, 12, 1024) == 64  # 85 rows would fit; 64 divide the batch.
  assert slots.chunk_rows(128, 64, 1024) == 16
  assert slots.chunk_rows(100, 16, 1024) == 50
  assert slots.chunk_rows(32, 8, 1024) == 32  # Few tokens: the batch whole.
  assert slots.chunk_rows(3, 600, 1024) == 1  # A row over the budget is still encoded.
  assert slots.chunk_rows(128, 64, 0) == 128
  assert platforms.settings("cpu").encode_tokens == 1024
  assert platforms.settings("gpu").encode_tokens == 0
  traced = []
  encode = lambda params, src, width: (traced.append(src.shape), {
      "n": jnp.sum(src != SPECIALS.pad, axis=1), "width": jnp.full(src.shape[:1], width)})[1]
  src = jnp.asarray(np.arange(6 * 8).reshape(6, 8) % 5, jnp.int32)
  out = jax.jit(lambda src: slots.encode_in_chunks(encode, 12, 16, None, src))(src)
  assert traced == [(2, 8)]  # Three chunks of two rows, one traced body.
  np.testing.assert_array_equal(out["n"], np.sum(np.asarray(src) != SPECIALS.pad, axis=1))
  assert out["width"].tolist() == [12] * 6


def test_sources_encoded_in_chunks_decode_as_a_batch_of_their_width(trained, sources):
  """Encoder batches split into chunks of rows (a tiny budget here, so that the smoke
  model's batches are split) give each sentence the tokens and scores of the batch decoder."""
  chunked = Translator(trained[1])
  chunked.encode_tokens = 24  # 4 slots: 2 rows a chunk up to 12 tokens wide, 1 row beyond.
  options = DecodeOptions(beam_size=4, alpha=0.6)
  src, rows = _rows(chunked, sources)
  widths = np.array([-(-len(r) // 8) * 8 for r in rows])
  tokens, scores = chunked.decode(src, options, widths=widths)
  got = chunked.decode_slots(rows, options, num_slots=4)
  assert {d.width for d in chunked._slot_decoders.values()} == set(chunked.slot_widths)
  for i, (slot_tokens, slot_scores) in enumerate(got):
    n = min(slot_tokens.shape[1], tokens.shape[2])
    np.testing.assert_array_equal(slot_tokens[:, :n], tokens[i, :, :n], err_msg=str(i))
    np.testing.assert_allclose(slot_scores, scores[i], rtol=1e-5, atol=1e-5)


def test_an_ensembles_sources_encoded_in_chunks_decode_as_its_one_member_does(trained,
                                                                             sources):
  """An ensemble's encoder state (one per member) is split into chunks of rows as one
  model's is: a workdir with itself decodes, in chunks, as the workdir."""
  one, two = Translator(trained[1]), Translator([trained[1], trained[1]])
  one.encode_tokens = two.encode_tokens = 24
  _, rows = _rows(one, sources)
  options = DecodeOptions(beam_size=1)
  alone = one.decode_slots(rows, options, num_slots=4)
  both = two.decode_slots(rows, options, num_slots=4)
  for i, ((tokens, scores), (ensemble_tokens, ensemble_scores)) in enumerate(zip(alone, both)):
    np.testing.assert_array_equal(ensemble_tokens, tokens, err_msg=str(i))
    np.testing.assert_allclose(ensemble_scores, scores, atol=1e-4)


@pytest.mark.quick
def test_the_servers_warm_up_compiles_every_program_its_pieces_meet():
  """A piece's width is its length rounded up to 8 and an encoder batch's its longest's
  rounded up to 4: the slots' warm-up compiles the encoder for each of those and every other
  program, and calls the run sizes and small encoder batches once, so that traffic meets no
  program still to compile once it is done."""
  from transformer_jax.serving.batcher import Kind, SlotBatcher
  store, runs = ProgramStore(None), collections.Counter()

  decoders = {}

  def stream(beam_size, width):  # One decoder a class, as the server's (Translator's cache).
    if (beam_size, width) not in decoders:
      decoder = decoders[beam_size, width] = slots.SlotDecoder(
          _counting_model(vocab=32), None, 4, width, width + 10, SPECIALS, beam_size=beam_size,
          programs=store)
      for rows, run in list(decoder._runs.items()):
        decoder._runs[rows] = _watched(run, lambda out, rows=rows, width=width: runs.update(
            [(width, rows, int(out[2]) > 0)]))
    return streams.SlotStream(decoders[beam_size, width])

  batcher = SlotBatcher(stream, [8, 16], max_queue=64, margin=10)
  batcher.start([(8, 1), (16, 1)])
  _wait_compiled(batcher)
  assert batcher.shapes_done == batcher.shapes_total == 2
  compiled = store.compiled
  # Two classes' decoders (sources of up to 8 and 16 tokens): encoder batches of 1, 2 and 4
  # rows at widths 4 and 8, and 12 and 16; each, 3 run sizes (which give their results),
  # refill for 1 and 2 rows, feed, compact, and the empty state.
  assert compiled == 2 * 3 * 2 + 2 * (3 + 2 + 3)
  # Each run size but that of every slot was run for some steps (4 sources at once go to the
  # feed program).
  assert {key for key in runs if key[2]} == {(w, r, True) for w in (8, 16) for r in (1, 2)}
  jobs = [batcher.submit([([7] * (n - 1) + [SPECIALS.eos], Kind(-(-n // 8) * 8, 1, 0.6))])
          for n in range(1, 17)]
  for n, job in enumerate(jobs, 1):
    (tokens, _), = job.future.result(timeout=60)
    assert tokens[0][:n].tolist() == [5 + i for i in range(n - 1)] + [SPECIALS.eos]
  batcher.stop()
  assert store.compiled == compiled


@pytest.mark.quick
def test_the_servers_lanes_share_a_class_and_each_answer_is_its_own():
  """With two lanes a class's pieces are split between two streams of one decoder (the least
  loaded takes the next), which step at once; every answer is still its own sentence's."""
  from transformer_jax.serving.batcher import Kind, SlotBatcher
  decoder = slots.SlotDecoder(_counting_model(vocab=32), None, 8, 16, 26, SPECIALS, beam_size=3)
  taken, steps = collections.defaultdict(list), []
  for rows, run in list(decoder._runs.items()):
    decoder._runs[rows] = _watched(run, lambda out: steps.append(int(out[2])))

  def stream(beam_size, width):
    assert (beam_size, width) == (3, 16)
    lane = streams.SlotStream(decoder)  # The lanes share the decoder (its programs).
    put = lane.put
    lane.put = lambda item, ids, *rest: (taken[id(lane)].append(len(ids)), put(item, ids, *rest))
    return lane

  batcher = SlotBatcher(stream, [16], max_queue=64, margin=10, lanes=2)
  batcher.start([(8, 3), (16, 3)])
  _wait_compiled(batcher)
  taken.clear(), steps.clear()  # The warm-up's (on a stream of its own).
  lengths = [n for n in range(2, 17)] * 2
  jobs = [batcher.submit([([7] * (n - 1) + [SPECIALS.eos], Kind(-(-n // 8) * 8, 3, 0.6))])
          for n in lengths]
  for n, job in zip(lengths, jobs):
    (tokens, _), = job.future.result(timeout=60)
    assert tokens[0][:n].tolist() == [5 + i for i in range(n - 1)] + [SPECIALS.eos]
  batcher.stop()
  assert len(taken) == 2  # Both lanes took pieces,
  assert sorted(sum(taken.values(), [])) == sorted(lengths)  # each piece once.
  # A piece's arrival costs no run of no steps: every run stepped until a search ended.
  assert steps and min(steps) >= 1
  with pytest.raises(ValueError, match="lanes must be at least 1"):
    SlotBatcher(stream, [16], max_queue=64, margin=10, lanes=0)


@pytest.mark.quick
@pytest.mark.parametrize("beam_size", [1, 3])
def test_sentences_leave_the_slots_at_their_own_ends_and_new_ones_take_them(beam_size):
  lengths = [9, 2, 5, 3, 12, 4, 7, 2, 6, 3, 10, 5]
  sources = [np.array([7] * (n - 1) + [SPECIALS.eos], np.int32) for n in lengths]
  decoder = slots.SlotDecoder(_counting_model(), None, 4, 16, 20, SPECIALS, beam_size=beam_size)
  finished = []
  results = streams.decode_all(decoder, sources, [20] * len(sources), progress=finished.append)
  for n, (tokens, scores) in zip(lengths, results):
    expected = [5 + i for i in range(n - 1)] + [SPECIALS.eos]
    assert tokens[0][:n].tolist() == expected and (tokens[0][n:] == SPECIALS.pad).all()
    assert scores.shape == (beam_size,)
  assert sum(finished) == len(lengths) and len(finished) > 3  # Many runs, each ending some.


@pytest.mark.quick
@pytest.mark.parametrize("beam_size", [1, 2])
def test_a_files_sources_take_the_free_slots_between_steps_without_returning(beam_size):
  """96 sources, 16 slots: each batch of 16 encoded sources is taken in by one call of the
  feed program (a slot that frees up takes the next source between two steps), not by a run
  and a refill each time a few slots are free; only the last searches end in a run. Every
  output is still right."""
  lengths = [2 + (7 * i) % 20 for i in range(96)]
  sources = [np.array([7] * (n - 1) + [SPECIALS.eos], np.int32) for n in lengths]
  decoder = slots.SlotDecoder(_counting_model(vocab=32), None, 16, 24, 24, SPECIALS,
                              beam_size=beam_size)
  calls = []
  feed, refill = decoder._feed, decoder._refill
  decoder._feed = lambda *args: (calls.append("feed"), feed(*args))[1]
  decoder._refill = lambda *args: (calls.append("refill"), refill(*args))[1]
  for size, run in list(decoder._runs.items()):
    decoder._runs[size] = lambda *args, run=run, size=size: (calls.append(size), run(*args))[1]
  results = streams.decode_all(decoder, sources, [24] * len(sources))
  for n, (tokens, _) in zip(lengths, results):
    assert tokens[0][:n].tolist() == [5 + i for i in range(n - 1)] + [SPECIALS.eos]
  assert calls[:6] == ["feed"] * 6 and "feed" not in calls[6:] and "refill" not in calls
  assert 1 <= len(calls[6:]) <= 2  # The last searches: the run sizes that hold them.


@pytest.mark.quick
@pytest.mark.parametrize("beam_size", [1, 3])
def test_lanes_decode_every_source_as_one_stream_does(beam_size):
  """Two and three lanes (streams stepping at once in threads of their own) give every
  sentence what one stream gives it, and compute no more decoder rows than the searches need
  beyond one stream's tails."""
  lengths = [9, 2, 5, 3, 12, 4, 7, 2, 6, 3, 10, 5, 8, 11, 2, 4]
  sources = [np.array([7] * (n - 1) + [SPECIALS.eos], np.int32) for n in lengths]
  decoder = slots.SlotDecoder(_counting_model(), None, 4, 16, 20, SPECIALS, beam_size=beam_size)
  one = streams.decode_all(decoder, sources, [20] * len(sources))
  for lanes in (2, 3):
    finished = []
    got = streams.decode_all(decoder, sources, [20] * len(sources), progress=finished.append,
                             lanes=lanes)
    assert sum(finished) == len(sources)
    for (a_tokens, a_scores), (b_tokens, b_scores) in zip(one, got):
      np.testing.assert_array_equal(a_tokens, b_tokens)
      np.testing.assert_array_equal(a_scores, b_scores)


@pytest.mark.quick
def test_lanes_take_jobs_from_both_ends_and_give_each_source_what_one_stream_does():
  """Jobs for decoders of two widths (translate's width classes), two lanes: one lane starts
  on the first job and the other on the last, each going on to the other job without waiting,
  and every source gets what one stream of its own decoder gives it."""
  narrow = slots.SlotDecoder(_counting_model(), None, 4, 8, 12, SPECIALS)
  wide = slots.SlotDecoder(_counting_model(), None, 4, 16, 20, SPECIALS)
  first_batch = {}  # Per lane (thread): the width of its first encoder batch.
  for decoder in (narrow, wide):
    def encode(params, src, plain=decoder._encode, width=decoder.width):
      first_batch.setdefault(threading.current_thread().name, width)
      return plain(params, src)
    decoder._encode = encode
  lengths = {8: [3 + i % 6 for i in range(30)], 16: [9 + i % 8 for i in range(30)]}
  sources = {w: [np.array([7] * (n - 1) + [SPECIALS.eos], np.int32) for n in lengths[w]]
             for w in lengths}
  jobs = [streams.Job(wide, sources[16], [20] * 30, 0.6),
          streams.Job(narrow, sources[8], [12] * 30, 0.6)]
  finished = []
  got = streams.decode_jobs(jobs, progress=finished.append, lanes=2)
  assert sorted(first_batch.values()) == [8, 16]
  assert sum(finished) == 60
  for job, results in zip(jobs, got):
    one = streams.decode_all(job.decoder, job.sources, job.limits)
    for (a_tokens, a_scores), (b_tokens, b_scores) in zip(one, results):
      np.testing.assert_array_equal(a_tokens, b_tokens)
      np.testing.assert_array_equal(a_scores, b_scores)


@pytest.mark.quick
def test_an_error_in_one_lane_stops_the_others_and_is_raised():
  sources = [np.array([7] * 11 + [SPECIALS.eos], np.int32) for _ in range(40)]
  decoder = slots.SlotDecoder(_counting_model(), None, 2, 16, 20, SPECIALS)
  calls = []

  def progress(n):
    calls.append(n)
    raise RuntimeError("the output file's disk is full")

  with pytest.raises(RuntimeError, match="disk is full"):
    streams.decode_all(decoder, sources, [20] * len(sources), progress=progress, lanes=2)
  assert len(calls) <= 4  # Each lane stopped at its next run, not at the end of its sources.


@pytest.mark.quick
def test_after_an_error_no_lane_starts_another_job():
  """Three jobs, two lanes, the first progress report fails: each lane has opened at most the
  stream of its first job (a stream's state is allocated when it opens) when the error is
  raised."""
  decoders = [slots.SlotDecoder(_counting_model(), None, 2, 16, 20, SPECIALS) for _ in range(3)]
  opened = []
  for decoder in decoders:
    empty = decoder._empty
    decoder._empty = lambda params, plain=empty: (opened.append(1), plain(params))[1]
  sources = [np.array([7] * 11 + [SPECIALS.eos], np.int32) for _ in range(40)]
  jobs = [streams.Job(d, sources, [20] * 40, 0.6) for d in decoders]

  reports = []

  def progress(n):  # Only the first report fails: the other lane goes on until it sees that.
    reports.append(n)
    if len(reports) == 1:
      raise RuntimeError("the output file's disk is full")

  with pytest.raises(RuntimeError, match="disk is full"):
    streams.decode_jobs(jobs, progress=progress, lanes=2)
  assert len(opened) <= 2


@pytest.mark.quick
def test_run_sizes_halve_or_quarter_down_to_a_sixteenth_of_the_slots():
  assert slots.run_sizes(128) == [8, 16, 32, 64, 128]
  assert slots.run_sizes(32) == [2, 4, 8, 16, 32]
  assert slots.run_sizes(3) == [1, 2, 3]
  assert slots.run_sizes(1) == [1]
  assert slots.run_sizes(128, fraction=1) == [128]  # An accelerator's: one size.
  # A file's: quartered.
  assert slots.run_sizes(128, ratio=slots.RUN_RATIO["file"]) == [8, 32, 128]
  assert slots.run_sizes(32, ratio=4) == [2, 8, 32]
  assert slots.run_sizes(40, ratio=4) == [3, 10, 40]
  assert slots.run_sizes(3, ratio=4) == [1, 3]
  with pytest.raises(ValueError, match="at least 2"):
    slots.run_sizes(8, ratio=1)


def test_a_files_slot_decoders_quarter_their_run_sizes_and_a_servers_halve_them(
    translator, sources, monkeypatch):
  """decode_slots (a file) decodes with decoders whose runs quarter; the server's
  (slot_decoder's default) halve; each kind is made once per setting."""
  _, rows = _rows(translator, sources)
  options = DecodeOptions(beam_size=1, alpha=0.6)
  files = []
  decode_jobs = streams.decode_jobs

  def spy(jobs, **kwargs):
    files.extend(job.decoder for job in jobs)
    return decode_jobs(jobs, **kwargs)

  monkeypatch.setattr(streams, "decode_jobs", spy)
  translator.decode_slots(rows, options, num_slots=3)
  assert len(files) >= 2 and all(d.run_sizes == [1, 3] for d in files)  # A class or more.
  server = translator.slot_decoder(options, 3, files[0].width)
  assert server.run_sizes == [1, 2, 3] and all(server is not d for d in files)
  assert translator.slot_decoder(options, 3, files[0].width, use="file") is files[0]


@pytest.mark.quick
@pytest.mark.parametrize("beam_size", [1, 2])
def test_steps_compute_the_rows_of_the_running_searches_not_of_every_slot(beam_size):
  """16 slots, 20 sources of 2 to 21 tokens (the counting model: a source of n tokens
  decodes n steps). The model's cache counts the steps each row computed, and moves with its
  slot when the running searches are compacted: once the sources are all in, the last,
  longest searches run in fewer and fewer leading slots. Every output is still right."""
  lengths = [2 + (7 * i) % 20 for i in range(20)]
  sources = [np.array([7] * (n - 1) + [SPECIALS.eos], np.int32) for n in lengths]
  decoder = slots.SlotDecoder(_counting_model(vocab=32), None, 16, 24, 24, SPECIALS,
                              beam_size=beam_size)
  sizes = []
  for size, run in list(decoder._runs.items()):
    decoder._runs[size] = lambda *args, run=run, size=size: (sizes.append(size), run(*args))[1]
  stream = streams.SlotStream(decoder)
  for i, ids in enumerate(sources):
    stream.put(i, ids, 24, 0.6)
  results = {}
  while stream.busy:
    for item, tokens, _ in stream.advance(min_free=decoder.slots + 1):
      results[item] = tokens[0]
  for i, n in enumerate(lengths):
    assert results[i][:n].tolist() == [5 + j for j in range(n - 1)] + [SPECIALS.eos]
  assert sizes[:2] == [16, 16] and sizes[-1] == 1 and {8, 4, 2} <= set(sizes)
  computed = int(np.asarray(stream._state["cache"]["calls"]).sum())
  assert computed == decoder.rows_stepped
  busy = sum(lengths) * beam_size  # Row-steps the searches themselves need.
  # Every slot stepped at every step would be 16 rows x the steps run.
  assert busy <= computed < 0.8 * decoder.slots * beam_size * decoder.steps_run


def test_slot_programs_kept_on_disk_decode_as_the_traced_ones(translator, sources, tmp_path):
  """A decoder whose programs a ProgramStore kept (traced by the first, loaded by the second
  without tracing) decodes what a decoder of plain jax.jit programs does."""
  src, rows = _rows(translator, sources[:10])
  width = src.shape[1]
  limits = [width + 10] * len(rows)

  def decoder(programs):
    return slots.SlotDecoder(generation.slot_model(translator.model), translator.params, 3,
                             width, width + 10, SPECIALS, beam_size=2, programs=programs)

  plain = streams.decode_all(decoder(ProgramStore(None)), rows, limits)
  kept = streams.decode_all(decoder(ProgramStore(tmp_path)), rows, limits)
  kept_names = {p.name.split("-")[0] for p in tmp_path.iterdir()}
  # Batches of 3 sources go through the feed program, the last one by a refill and a run.
  runs = {"slots_run_1", "slots_run_2", "slots_run_3"}
  assert {"slots_empty", "slots_encode", "slots_feed", "slots_refill"} <= kept_names <= {
      "slots_empty", "slots_encode", "slots_feed", "slots_refill", "slots_compact", *runs}
  assert kept_names & runs
  loaded = streams.decode_all(decoder(ProgramStore(tmp_path)), rows, limits)
  for a, b, c in zip(plain, kept, loaded):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0], c[0])
    np.testing.assert_allclose(a[1], c[1], rtol=1e-6)


def test_no_decoder_emits_the_padding_of_the_models_vocabulary(trained, sources):
  """The model's vocabulary is the tokenizer's padded to a multiple of 128; the extra ids are
  no tokens. Here their rows of the (tied) output table are made 3x the first real ids' rows,
  so they outscore those ids wherever these score above zero: the uncut batch decoder then
  emits them, and neither of the translator's decoders does (greedy and beam 4)."""
  t = Translator(trained[1])
  vocab, padded = t.tokenizers.tgt.vocab_size, t.model.cfg.tgt_vocab_size
  assert padded > vocab and t.model.cfg.tie_output

  def boosted(path, x):
    if path[-1].key == "embedding" and x.shape[0] == padded:
      return x.at[vocab:].set(3 * x[:padded - vocab])
    return x
  t.all_params = (jax.tree_util.tree_map_with_path(boosted, t.params),)
  src, rows = _rows(t, sources[:16])
  max_len = src.shape[1] + 10
  uncut = np.asarray(jax.jit(lambda p, s: generation.scored(
      t.model, p, s, max_len, 1, 0.6)[0])(t.params, src))
  assert (uncut >= vocab).any()  # The boost bites.
  for beam_size in (1, 4):
    options = DecodeOptions(beam_size=beam_size)
    tokens, _ = t.decode(src, options)
    assert tokens.max() < vocab
    assert max(out.max() for out, _ in t.decode_slots(rows, options, num_slots=4)) < vocab


_CACHE_CHILD = """
import sys
import threading
import jax, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from transformer_jax.decoding import generation, slots, streams
from transformer_jax.programs import ProgramStore
from transformer_jax.decoding.translator import SPECIALS, Translator

translator = Translator(sys.argv[1])
rows = [np.array([5 + (7 * i + j) % 40 for j in range(2 + i % 9)] + [SPECIALS.eos], np.int32)
        for i in range(10)]

def decode(programs):
  decoder = slots.SlotDecoder(generation.slot_model(translator.model), translator.params, 3,
                              16, 26, SPECIALS, beam_size=2, programs=programs)
  return [tokens.tolist() for tokens, _ in streams.decode_all(decoder, rows, [26] * len(rows))]

outs = []
if sys.argv[4] == "all":  # jax.jit's programs first (into the cache), then a store's.
  outs = [decode(ProgramStore(None)), decode(ProgramStore(sys.argv[3]))]
outs.append(decode(ProgramStore(sys.argv[3])))
assert all(out == outs[0] for out in outs)
print(outs[-1])
"""


def test_slot_programs_kept_beside_the_compilation_cache_run_here_and_in_a_later_process(
    trained, tmp_path):
  """Slot programs that jax.jit compiled into the persistent compilation cache, then kept by a
  store and loaded by another, decode alike in that process and in a later one: a store
  compiles apart from the cache (on a CPU an executable the cache gives back serializes
  without some of its kernels, and a copy loaded from that fails: "Function ... not found")."""
  cache, store = tmp_path / "jax_cache", tmp_path / "programs"
  run = lambda mode: subprocess.run(
      [sys.executable, "-c", _CACHE_CHILD, str(trained[1]), str(cache), str(store), mode],
      capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
  first = run("all")
  assert first.returncode == 0, first.stderr[-3000:]
  assert list(cache.iterdir())  # The cache was on: jax.jit's programs went into it,
  assert not list(cache.glob("*kept_*"))  # and none of the store's.
  kept = {p.name.split("-")[0] for p in store.glob("*.executable")}
  assert "slots_feed" in kept and any(name.startswith("slots_run_") for name in kept)
  later = run("loaded")
  assert later.returncode == 0, later.stderr[-3000:]
  assert later.stdout == first.stdout and first.stdout.startswith("[[")


def test_greedy_slots_without_scores_give_the_same_tokens_and_translate_skips_them(translator,
                                                                                    sources):
  """A greedy search's score costs a log-softmax over the vocabulary at every step: decoders
  without scores give the same tokens, scores of 0, and translate's output (no n-best) uses
  them."""
  _, rows = _rows(translator, sources)
  options = DecodeOptions(beam_size=1, alpha=0.6)
  scored = translator.decode_slots(rows, options, num_slots=3)
  unscored = translator.decode_slots(rows, dataclasses.replace(options, scores=False), 3)
  for i, ((tokens, scores), (tokens_unscored, zeros)) in enumerate(zip(scored, unscored)):
    np.testing.assert_array_equal(tokens_unscored, tokens, err_msg=str(i))
    assert (zeros == 0).all()
  assert any((scores != 0).any() for _, scores in scored)
  decoders = translator._slot_decoders
  assert {d.scores for d in decoders.values() if d.k == 1} == {True, False}
  # Beam search ranks by its scores: a decoder of 2 beams computes them whatever is asked.
  beams = translator.slot_decoder(DecodeOptions(beam_size=2, scores=False), 3)
  assert beams.scores and beams is translator.slot_decoder(DecodeOptions(beam_size=2), 3)
  lines = sources[:12]
  batched = translate_lines(translator, lines, options, batch_size=8, progress=False,
                            segment_over=None)
  count = len(decoders)
  assert translate_lines(translator, lines, options, batch_size=8, progress=False,
                         segment_over=None, num_slots=3) == batched
  assert len(decoders) == count  # The decoders without scores made above, used again.
