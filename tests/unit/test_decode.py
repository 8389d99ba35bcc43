import itertools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_model_config
from transformer_jax.decoding import search, generation
from transformer_jax.data.tokenizer import BOS, EOS, PAD
from transformer_jax.decoding.generation import SPECIALS
from transformer_jax.models.transformer import Transformer

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


@pytest.fixture(scope="module")
def tiny():
  cfg = tiny_model_config()
  model = Transformer(cfg)
  x = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), x, x)["params"])
  return model, params


@pytest.mark.parametrize("pre_ln", [False, True])
def test_cached_steps_equal_the_teacher_forced_forward_pass(pre_ln):
  model = Transformer(tiny_model_config(pre_ln=pre_ln))
  src = jnp.array([[5, 6, 7, 8, 9, 2], [11, 12, 2, 0, 0, 0]])  # Two source lengths.
  tgt = jnp.array([[BOS, 20, 21, 22, 23], [BOS, 30, 31, 32, 33]])
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), src, tgt)["params"])
  full = model.apply({"params": params}, src, tgt)  # [B, T, V]
  step, cache = generation.decoder(model, params, src, max_len=8)
  for t in range(tgt.shape[1]):
    logits, cache = step(tgt[:, t:t + 1], cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, t]), atol=1e-5, rtol=1e-5)
  assert int(cache["index"]) == tgt.shape[1]


def test_a_source_alone_and_inside_a_padded_batch_decode_the_same(tiny):
  model, params = tiny
  alone = jnp.array([[11, 12, 13, 2]])
  batch = jnp.array([[11, 12, 13, 2, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 2]])
  for beam in (1, 3):
    a = generation.translate_ids(model, params, alone, 6, beam_size=beam)
    b = generation.translate_ids(model, params, batch, 6, beam_size=beam)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))


def _fake_model(table):
  """tokens_to_logits from a fixed table of log-probs indexed by the previous token; the cache
  counts steps so that the table can also depend on position."""
  table = jnp.asarray(table, jnp.float32)  # [L, V, V]: step, previous token -> logits

  def tokens_to_logits(tokens, cache):
    return table[cache["t"], tokens[:, 0]], {"t": cache["t"] + 1, "rows": cache["rows"]}
  return tokens_to_logits


def _random_table(seed, length=4, vocab=5):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(length, vocab, vocab)) * 2
  logits[:, :, PAD] = -1e9  # Never emit padding or <bos> ...
  logits[:, :, BOS] = -1e9
  return np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))


def _exhaustive_best(table, alpha):
  """Best score over every sequence that ends in <eos> within the table's length."""
  length, vocab = table.shape[:2]
  best, best_seq = -np.inf, None
  for n in range(1, length + 1):
    for body in itertools.product(range(3, vocab), repeat=n - 1):
      seq, prev, logp = list(body) + [EOS], BOS, 0.0
      for t, tok in enumerate(seq):
        logp += table[t, prev, tok]
        prev = tok
      score = logp / search.length_penalty(n, alpha)
      if score > best:
        best, best_seq = score, seq
  return best, best_seq


@pytest.mark.parametrize("seed", range(5))
def test_large_beam_finds_the_exhaustive_optimum(seed):
  table = _random_table(seed)
  table[-1, :, 3:] = -1e9  # The last step must emit <eos>: every hypothesis ends.
  table = table - np.log(np.exp(table).sum(-1, keepdims=True))
  best, best_seq = _exhaustive_best(table, alpha=0.6)
  cache = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((1,))}
  tokens, scores = search.beam_search(_fake_model(table), cache, 1, 4, SPECIALS, beam_size=16,
                                      alpha=0.6)
  assert search.strip(tokens[0, 0], SPECIALS) + [EOS] == best_seq
  np.testing.assert_allclose(float(scores[0, 0]), best, rtol=1e-5)


def _first_k_reference(table, k, alpha):
  """CTranslate2's beam search (patience 1) written plainly, scored by GNMT's penalty: every
  step ranks all continuations of the live beams; an <eos> among the K best ends a hypothesis;
  the K best others live on; the search ends once K hypotheses have ended. Returns the K best
  (score, tokens with <eos>)."""
  length, vocab = table.shape[:2]
  live, ended = [([], 0.0)], []
  for t in range(length):
    candidates = sorted(((logp + table[t, seq[-1] if seq else BOS, token], seq + [token])
                         for seq, logp in live for token in range(vocab)), key=lambda c: -c[0])
    ended += [(logp / search.length_penalty(len(seq), alpha), seq)
              for logp, seq in candidates[:k] if seq[-1] == EOS]
    live = [(seq, logp) for logp, seq in candidates[:2 * k] if seq[-1] != EOS][:k]
    if len(ended) >= k:
      break
  return sorted(ended, key=lambda c: -c[0])[:k]


@pytest.mark.parametrize("seed", range(8))
def test_first_k_beam_search_ends_as_ctranslate2_does(seed):
  table = _random_table(seed, length=6, vocab=7)
  table[-1, :, 3:] = -1e9  # Every hypothesis ends by the last step.
  table = table - np.log(np.exp(table).sum(-1, keepdims=True))
  cache = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((1,))}
  tokens, scores = search.beam_search(_fake_model(table), cache, 1, 6, SPECIALS, beam_size=3,
                                      alpha=0.6, stop="first_k")
  want = _first_k_reference(table, 3, alpha=0.6)
  assert [search.strip(row, SPECIALS) + [EOS] for row in np.asarray(tokens[0])] == [
      seq for _, seq in want]
  np.testing.assert_allclose(np.asarray(scores[0]), [score for score, _ in want], rtol=1e-5)


def test_a_beam_search_stops_sooner_by_first_k_and_exact_finds_what_it_missed():
  """An empty output and a one-token one end first; a two-token output that the length
  penalty lifts above them ends a step later: first_k stops before it, exact finds it."""
  table = np.full((5, 6, 6), -30.0)
  table[:, :, EOS] = 0.0  # Anything else ends.
  table[0, BOS, [EOS, 3, 4]] = np.log([0.5, 0.45, 0.05])
  table[1, 3, [EOS, 3]] = np.log([0.3, 0.7])
  table[2, 3, [EOS, 3]] = np.log([0.99, 0.01])
  table = table - np.log(np.exp(table).sum(-1, keepdims=True))
  cache = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((1,))}
  run = lambda stop: search.beam_search(_fake_model(table), cache, 1, 5, SPECIALS, beam_size=2,
                                        alpha=2.0, stop=stop)
  (first, first_scores), (exact, exact_scores) = run("first_k"), run("exact")
  assert search.strip(first[0, 0], SPECIALS) == []
  np.testing.assert_allclose(float(first_scores[0, 0]), np.log(0.5), rtol=1e-4)
  assert search.strip(exact[0, 0], SPECIALS) == [3, 3]
  np.testing.assert_allclose(float(exact_scores[0, 0]),
                             np.log(0.45 * 0.7 * 0.99) / search.length_penalty(3, 2.0), rtol=1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_beams_stay_in_place_and_copies_never_read_an_overwritten_row(seed):
  """The in-place cache update equals a gather of every row from its parent."""
  rng = np.random.default_rng(seed)
  b, k = 3, 4
  parents = jnp.asarray(rng.integers(0, k, size=(b, k)), jnp.int32)
  place = search._stay_in_place(parents)
  assert (np.sort(np.asarray(place), axis=1) == np.arange(k)).all()  # A permutation.
  placed = np.take_along_axis(np.asarray(parents), np.asarray(place), axis=1)
  for row in placed:  # A beam with a continuation keeps its first one in its own place.
    assert all(row[j] == j for j in set(row.tolist()))
  cache = {"k": jnp.asarray(rng.normal(size=(b * k, 2, 5)), jnp.float32),
           "index": jnp.zeros((), jnp.int32)}
  got = search._copy_parents(cache, jnp.asarray(placed))
  rows = (np.arange(b)[:, None] * k + placed).reshape(-1)
  np.testing.assert_array_equal(np.asarray(got["k"]), np.asarray(cache["k"])[rows])
  gathered = search._copy_parents(cache, jnp.asarray(placed), copy="gather")  # An accelerator's.
  np.testing.assert_array_equal(np.asarray(gathered["k"]), np.asarray(cache["k"])[rows])
  with pytest.raises(ValueError, match="row copy 'scatter'"):
    search._copy_parents(cache, jnp.asarray(placed), copy="scatter")

  # Copying only the positions written (axis -2 of [rows, N, 13, H]): those equal the gather's,
  # the rest of a moved row is left as it was, and no more than the smallest fraction is copied.
  positions = jnp.asarray(rng.normal(size=(b * k, 2, 13, 3)), jnp.float32)
  for written in (1, 3, 4, 5, 7, 13):
    got = search._copy_parents({"k": positions}, jnp.asarray(placed), jnp.int32(written), -2)
    copied = next(-(-13 // f) for f in search.COPY_FRACTIONS if written <= -(-13 // f))
    want = np.array(positions)
    want[:, :, :copied] = np.asarray(positions)[rows][:, :, :copied]
    np.testing.assert_array_equal(np.asarray(got["k"]), want, err_msg=str(written))


def test_beam_one_temperature_zero_and_top_k_one_equal_greedy():
  table = _random_table(7, length=6)
  cache = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((3,))}
  fake = _fake_model(table)
  greedy = search.sample(fake, cache, 3, 6, SPECIALS)
  beam1, _ = search.beam_search(fake, cache, 3, 6, SPECIALS, beam_size=1, alpha=0.0)
  np.testing.assert_array_equal(np.asarray(beam1[:, 0]), np.asarray(greedy))
  cold = search.sample(fake, cache, 3, 6, SPECIALS, search.Sampling(temperature=1e-4),
                       jax.random.PRNGKey(3))
  np.testing.assert_array_equal(np.asarray(cold), np.asarray(greedy))
  top1 = search.sample(fake, cache, 3, 6, SPECIALS, search.Sampling(top_k=1), jax.random.PRNGKey(4))
  np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))
  nucleus = search.sample(fake, cache, 3, 6, SPECIALS, search.Sampling(top_p=1e-6),
                          jax.random.PRNGKey(5))
  np.testing.assert_array_equal(np.asarray(nucleus), np.asarray(greedy))


def test_rows_emit_padding_after_eos():
  table = np.full((5, 5, 5), -1e9)
  table[0, BOS, 4] = 0.0  # bos -> 4 -> eos, then the table would say 4 again.
  table[1, 4, EOS] = 0.0
  table[2:, :, 4] = 0.0
  cache = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((1,))}
  out = search.sample(_fake_model(table), cache, 1, 5, SPECIALS)
  assert out.tolist() == [[4, EOS, PAD, PAD, PAD]]


def test_decoding_compiles_once_per_batch_and_length(tiny):
  model, params = tiny
  traced = chex.assert_max_traces(search.sample, n=2)
  chex.clear_trace_counter()
  fn = jax.jit(lambda p, s: traced(*generation.decoder(model, p, s, 7), s.shape[0], 7,
                                   SPECIALS))
  src = jnp.array([[5, 6, 2, 0]])
  for _ in range(3):  # Same shapes: one trace, whatever the number of decoded tokens.
    fn(params, src)
  fn(params, jnp.array([[5, 6, 2, 0], [7, 2, 0, 0]]))  # A new batch size: a second trace.
  with pytest.raises(AssertionError):
    fn(params, jnp.array([[5, 6, 2, 0]] * 3))  # A third shape would be a third trace.


def test_sampling_rejects_bad_parameters():
  with pytest.raises(ValueError, match="temperature"):
    search.Sampling(temperature=0.0)
  with pytest.raises(ValueError, match="top_p"):
    search.Sampling(top_p=0.0)


@pytest.mark.parametrize("k", [1, 8])
def test_blocked_top_k_equals_lax_top_k_ties_included(k):
  rng = np.random.default_rng(k)
  # A vocabulary that is no multiple of the block, and few distinct values: many ties, within
  # blocks and across them.
  x = jnp.asarray(rng.integers(0, 6, size=(3, 5, 2011)).astype(np.float32))
  values, indices = search.top_k(x, k)
  want_values, want_indices = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
  np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
  normal = jnp.asarray(rng.normal(size=(7, 8000)).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(search.top_k(normal, k)[1]),
                                np.asarray(jax.lax.top_k(normal, k)[1]))
  np.testing.assert_array_equal(np.asarray(search.Greedy()(normal, None)),
                                np.argmax(np.asarray(normal), axis=-1))


def test_each_row_stops_at_its_own_limit_as_it_would_at_max_len():
  table = _random_table(11, length=6)
  table[:, :, EOS] -= 8.0  # Rarely ending: the limits decide the lengths.
  fake = _fake_model(table)
  limits = jnp.array([2, 4, 6])
  many = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((3,))}
  one = {"t": jnp.zeros((), jnp.int32), "rows": jnp.zeros((1,))}
  tokens, logprob = search.sample_scored(fake, many, 3, 6, SPECIALS, limits=limits)
  beams, scores = search.beam_search(fake, many, 3, 6, SPECIALS, beam_size=3, alpha=0.6,
                                     limits=limits)
  for row, limit in enumerate(limits.tolist()):
    alone, alone_logprob = search.sample_scored(fake, one, 1, limit, SPECIALS)
    np.testing.assert_array_equal(np.asarray(tokens[row, :limit]), np.asarray(alone[0]))
    assert not np.asarray(tokens[row, limit:]).any()  # <pad> after the limit.
    np.testing.assert_allclose(float(logprob[row]), float(alone_logprob[0]), rtol=1e-6)
    alone, alone_scores = search.beam_search(fake, one, 1, limit, SPECIALS, beam_size=3,
                                             alpha=0.6)
    np.testing.assert_array_equal(np.asarray(beams[row, :, :limit]), np.asarray(alone[0]))
    np.testing.assert_allclose(np.asarray(scores[row]), np.asarray(alone_scores[0]), rtol=1e-6)
  assert not np.asarray(tokens == EOS).any()  # Every row was cut by its limit, none ended.
