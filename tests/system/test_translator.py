"""n-best lists, ensembles and log-probabilities of a restored workdir (the trained smoke run)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from transformer_jax.decoding import search, generation
from transformer_jax.decoding import lines as lines_lib
from transformer_jax.data.tokenizer import EOS, PAD
from transformer_jax.decoding.generation import encode_sources
from transformer_jax.decoding.options import DecodeOptions, InferenceError
from transformer_jax.decoding.inputs import split_pairs
from transformer_jax.decoding.translator import Translator

ALPHA = 0.6


@pytest.fixture(scope="module")
def sources(trained):
  _, workdir = trained
  return split_pairs(str(workdir), "validation[:32]")[0]


@pytest.mark.parametrize("beam_stop", ["first_k", "exact"])
def test_n_best_lists_are_sorted_and_rescored_by_the_model(trained, sources, beam_stop):
  _, workdir = trained
  translator = Translator(workdir)
  options = DecodeOptions(beam_size=4, alpha=ALPHA, beam_stop=beam_stop)
  lists = translator.n_best(sources, 4, options)
  assert translator.translate(sources, options) == [entries[0][1] for entries in lists]
  for entries in lists:
    scores = [score for score, _ in entries]
    assert len(entries) == 4 and scores == sorted(scores, reverse=True)
    assert all(score > -1e8 for score in scores)  # Every slot is a real hypothesis.

  # Each beam's score is its log-probability under the model (teacher-forced) divided by the
  # length penalty: of its length with <eos> where it ended, of max_len where it did not.
  src = encode_sources(translator.tokenizers.src, sources, translator.max_src_len)
  max_len = src.shape[1] + options.max_len_margin
  tokens, scores = translator.decode(src, options)
  assert [[s for s, _ in entries] for entries in lists] == scores.tolist()
  rows = tokens.reshape(-1, max_len)  # [B*K, L]; <eos> then <pad> where a beam ended.
  ended = (rows == EOS).any(-1)
  if beam_stop == "exact":  # Both kinds of score are checked (first_k: the smoke model's
    assert ended.any() and not ended.all()  # <eos> seldom ranks among a step's K best).
  logp = np.asarray(generation.sequence_logprob(translator.model, translator.params,
                                                np.repeat(src, 4, axis=0), rows,
                                                translator.tokenizers.tgt.vocab_size))
  lengths = np.where(ended, (rows != PAD).sum(-1), max_len)
  np.testing.assert_allclose(logp / search.length_penalty(lengths, ALPHA), scores.reshape(-1),
                             rtol=2e-4, atol=2e-4)


def test_greedy_scores_are_the_models_log_probabilities_over_the_length_penalty(trained,
                                                                              sources):
  _, workdir = trained
  translator = Translator(workdir)
  src = encode_sources(translator.tokenizers.src, sources, translator.max_src_len)
  tokens, scores = translator.decode(src, DecodeOptions(beam_size=1, alpha=ALPHA))
  assert tokens.shape[1] == 1 and scores.shape == (len(sources), 1)
  assert translator.translate(sources, DecodeOptions(beam_size=1)) == [
      translator.tokenizers.tgt.decode(generation.strip(row)) for row in tokens[:, 0]]
  rows = tokens[:, 0]  # The 20-step smoke model's greedy outputs run to max_len.
  logp = np.asarray(generation.sequence_logprob(translator.model, translator.params, src, rows,
                                                translator.tokenizers.tgt.vocab_size))
  lengths = (rows != PAD).sum(-1)  # With <eos> where an output ended; max_len where not.
  np.testing.assert_allclose(logp / search.length_penalty(lengths, ALPHA), scores[:, 0],
                             rtol=2e-4, atol=2e-4)


def test_n_best_asks_for_at_most_the_beam(trained, sources):
  _, workdir = trained
  with pytest.raises(InferenceError, match="between 1 and the beam size"):
    Translator(workdir).n_best(sources[:2], 5, DecodeOptions(beam_size=4))


def _translate(*args):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "translate", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def test_n_best_file_format(trained, sources, tmp_path):
  _, workdir = trained
  (tmp_path / "in.txt").write_text(f"{sources[0]}\n\n{sources[1]}\n")
  result = _translate("--workdir", str(workdir), "--input", str(tmp_path / "in.txt"),
                      "--output", str(tmp_path / "out.tsv"), "--beam_size", "3", "--n_best", "2")
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [line.split("\t") for line in (tmp_path / "out.tsv").read_text().splitlines()]
  assert [(r[0], r[1]) for r in rows] == [("1", "1"), ("1", "2"), ("3", "1"), ("3", "2")]
  assert all(len(r) == 4 for r in rows)
  assert float(rows[0][2]) >= float(rows[1][2]) and float(rows[2][2]) >= float(rows[3][2])
  best = Translator(workdir).translate([sources[0], sources[1]], DecodeOptions(beam_size=3,
                                                                               alpha=1.0))
  assert [rows[0][3], rows[2][3]] == best  # The smoke config decodes with alpha 1.0.

  refused = _translate("--workdir", str(workdir), "--beam_size", "2", "--n_best", "3", "Go.")
  assert refused.returncode == 1
  assert refused.stderr.strip().splitlines()[-1] == (
      "error: --n_best 3 is more than the beam size (2): raise --beam_size")


def test_a_later_command_of_the_same_settings_has_the_list_of_programs_to_preload(
    trained, sources, tmp_path):
  """translate keeps the decoding slots' programs and the list of those it called (what the
  next command of the same settings loads while its checkpoint is restored)."""
  _, workdir = trained
  (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
  programs = tmp_path / "cache" / "programs"
  outputs = []
  for n, beam in enumerate(("1", "1", "2")):
    out = tmp_path / f"out{n}.txt"
    result = _translate("--workdir", str(workdir), "--input", str(tmp_path / "in.txt"),
                        "--beam_size", beam, "--compilation_cache_dir",
                        str(tmp_path / "cache"), "--output", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    outputs.append(out.read_text())
    lists = {path: json.loads(path.read_text()) for path in programs.glob("used-*.json")}
    assert len(lists) == (1 if beam == "1" else 2)
  assert outputs[0] == outputs[1]
  for names in lists.values():
    assert any(name.startswith("slots_run_") for name in names)
    assert all((programs / name).is_file() for name in names)


def test_an_ensemble_of_a_workdir_with_itself_translates_as_the_workdir(trained, sources,
                                                                        tmp_path):
  _, workdir = trained
  (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
  outputs = {}
  for name, workdirs in (("one", [workdir]), ("two", [workdir, workdir])):
    for mode, flags in (("greedy", ["--beam_size", "1"]),
                        ("n_best", ["--beam_size", "4", "--n_best", "4"])):
      given = [a for w in workdirs for a in ("--workdir", str(w))]
      out = tmp_path / f"{name}_{mode}.txt"
      result = _translate(*given, "--input", str(tmp_path / "in.txt"), *flags, "--output",
                          str(out))
      assert result.returncode == 0, result.stderr[-2000:]
      outputs[name, mode] = [line.split("\t") for line in out.read_text().splitlines()]
  assert outputs["one", "greedy"] == outputs["two", "greedy"]
  one, two = outputs["one", "n_best"], outputs["two", "n_best"]
  assert len(one) == 4 * len(sources)
  # The same hypotheses in the same order, with the same scores (the mean of equal
  # log-probabilities, renormalized).
  assert [(r[0], r[1], r[3]) for r in one] == [(r[0], r[1], r[3]) for r in two]
  np.testing.assert_allclose([float(r[2]) for r in one], [float(r[2]) for r in two], atol=1e-4)
  assert len({r[2] for r in one}) > len(sources)  # Scores differ: a real comparison.


def test_an_ensemble_needs_one_vocabulary(trained, tmp_path):
  _, workdir = trained
  other = tmp_path / "other"
  shutil.copytree(workdir, other)
  (other / "tokenizer.model").unlink()
  (other / "vocab.json").write_text('{"src": ["<pad>", "<bos>", "<eos>", "<unk>"], '
                                    '"tgt": ["<pad>", "<bos>", "<eos>", "<unk>"]}')
  with pytest.raises(InferenceError, match="has another vocabulary than .*: an ensemble needs "
                     "the same tokenizer"):
    Translator([workdir, other])


def test_batches_fit_the_row_budget_and_beam_search_gets_twice_it(trained, sources):
  _, workdir = trained
  translator = Translator(workdir)
  widths = {}
  for line, ids in zip(sources, translator.tokenizers.src.encode(sources)):
    widths.setdefault(-(-(len(ids) + 1) // 8) * 8, []).append(line)
  width, lines = max(widths.items(), key=lambda item: len(item[1]))  # The most common width.
  seen = []

  def translate(texts, options, numbers):
    seen.append((options.beam_size, len(texts)))
    return texts
  for beam_size in (1, 4):
    out = lines_lib._translate_each(
        translator, lines, [(range(len(lines)), DecodeOptions(beam_size=beam_size))],
        batch_size=64, progress=False, translate=translate, batch_tokens=width * 8)
    assert out == lines  # Every line once, in its place.
  # Greedy: 8 rows of `width` tokens a batch; beam 4: twice the budget, 16 rows = 4 sentences.
  assert {rows for beam, rows in seen if beam == 1} == {8}
  assert {rows for beam, rows in seen if beam == 4} == {8 * lines_lib.BEAM_BUDGET // 4}


def test_rows_of_different_widths_in_one_batch_decode_as_in_their_own(trained, sources):
  """The server joins sources of several widths into one batch: each row keeps its own width's
  output limit (a margin of 1 token makes the limits bite)."""
  _, workdir = trained
  translator = Translator(workdir)
  longer = [" ".join(sources[:n]) for n in range(1, 9)]
  by_width = {}  # The first of the longer and longer lines of each width the model takes.
  for line, ids in zip(longer, translator.tokenizers.src.encode(longer)):
    width = -(-(len(ids) + 1) // 8) * 8
    if width <= translator.max_src_len:
      by_width.setdefault(width, line)
  assert len(by_width) >= 3
  widths, lines = map(list, zip(*sorted(by_width.items())))
  joined = encode_sources(translator.tokenizers.src, lines, translator.max_src_len)
  for beam_size in (1, 4):
    options = DecodeOptions(beam_size=beam_size, alpha=ALPHA, max_len_margin=1)
    tokens, scores = translator.decode(joined, options, widths=np.array(widths))
    for i, (line, width) in enumerate(zip(lines, widths)):
      own = encode_sources(translator.tokenizers.src, [line], translator.max_src_len, width)
      own_tokens, own_scores = translator.decode(own, options)
      np.testing.assert_array_equal(tokens[i, :, :width + 1], own_tokens[0])
      assert not tokens[i, :, width + 1:].any()
      np.testing.assert_allclose(scores[i], own_scores[0], rtol=1e-5)
