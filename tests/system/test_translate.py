import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import DATA, ROOT, optimized_env
from transformer_jax import metrics
from transformer_jax.decoding.options import DecodeOptions
from transformer_jax.decoding.translator import Translator
from transformer_jax.runs.workdir import Workdir, WorkdirError


@pytest.fixture(scope="module")
def d2l_workdir(tmp_path_factory, tfds_dir):
  """configs/d2l_tiny.py trained in full by train.py (120 steps, under a minute on 2 cores)."""
  workdir = tmp_path_factory.mktemp("d2l")
  done = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/d2l_tiny.py", "--workdir", str(workdir),
       f"--config.data.data_dir={DATA / 'fra-eng'}", f"--config.data.tfds_dir={tfds_dir}"],
      cwd=ROOT, env=optimized_env(), capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  return workdir


def test_d2l_tiny_reproduces_the_chapters_table(d2l_workdir):
  translator = Translator(d2l_workdir)
  assert translator.step == 120
  english = ["I lost.", "I'm calm.", "I'm home."]
  french = ["j'ai perdu .", "je suis calme .", "je suis chez moi ."]
  out = translator.translate(english, DecodeOptions(beam_size=1))
  assert out == french
  assert [metrics.d2l_bleu(o, f, k=2) for o, f in zip(out, french)] == [1.0, 1.0, 1.0]
  # Beam search agrees on these easy sentences.
  assert translator.translate(english, DecodeOptions(beam_size=4)) == french


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "translate", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def test_translate_file_with_reference_prints_sacrebleu(d2l_workdir, tmp_path):
  (tmp_path / "in.txt").write_text("I lost.\nI'm home.\n")
  (tmp_path / "ref.txt").write_text("J'ai perdu.\nJe suis chez moi.\n")
  result = _cli("--workdir", str(d2l_workdir), "--input", str(tmp_path / "in.txt"),
                "--output", str(tmp_path / "out.txt"), "--reference", str(tmp_path / "ref.txt"),
                "--beam_size", "1", "--batch_size", "4")
  assert result.returncode == 0, result.stderr[-2000:]
  assert (tmp_path / "out.txt").read_text().splitlines() == ["j'ai perdu .", "je suis chez moi ."]
  assert "BLEU = " in result.stdout and "tok:13a" in result.stdout


def test_split_is_translated_and_scored_against_its_targets(d2l_workdir, tmp_path,
                                                          fra_eng_builder):
  from transformer_jax.data import sources
  pairs = sources.pairs(fra_eng_builder, "fra_eng", "validation[:40]")
  result = _cli("--workdir", str(d2l_workdir), "--split", "validation[:40]", "--beam_size", "1",
                "--output", str(tmp_path / "out.txt"))
  assert result.returncode == 0, result.stderr[-2000:]
  hypotheses = (tmp_path / "out.txt").read_text().splitlines()
  # The same sentences translated here, in order, and scored against the split's targets.
  from transformer_jax.decoding.lines import translate_lines
  assert hypotheses == translate_lines(Translator(d2l_workdir), [s for s, _ in pairs],
                                       DecodeOptions(beam_size=1), 64, progress=False)
  score, _ = metrics.corpus_bleu(hypotheses, [t for _, t in pairs])
  assert f"BLEU = {score:.2f}" in result.stdout
  result = _cli("--workdir", str(d2l_workdir), "--split", "validation", "--reference", "r.txt")
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
      "error: --split scores against the split's own targets: drop --reference")


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
  d = tmp_path_factory.mktemp("inputs")
  (d / "latin1.txt").write_bytes("I lost.\nJ'ai \xe9t\xe9 l\xe0.\n".encode("latin-1"))
  (d / "ok.txt").write_text("I lost.\n")
  (d / "a_file").write_text("")
  return d


@pytest.mark.parametrize("args,message", [
    (["--step", "7", "I lost."], "no checkpoint for step 7"),
    (["--input", "{d}/latin1.txt"], "{d}/latin1.txt line 2 is not UTF-8 text (byte 6: b'\\xe9')"),
    (["--batch_size", "0", "--input", "{d}/ok.txt"], "--batch_size must be at least 1, got 0"),
    (["--max_len", "100000", "Go."], "--max_len 100000 is over 36, 4 x the max_len the model"),
    (["--segment_over", "-2", "Go."], "--segment_over must be -1 (split none), 0 (all)"),
    (["--long_beam_size", "-1", "Go."], "--long_beam_size and --long_over must be 0 or positive"),
    (["--beam_size", "1", "--long_beam_size", "4", "Go."],
     "--long_beam_size needs beam search: --beam_size 1 decodes greedily"),
    (["--input", "{d}/ok.txt", "--output", "{d}/missing/out.txt"],
     "--output {d}/missing/out.txt: directory {d}/missing does not exist"),
])
def test_translate_errors_are_one_line_and_write_nothing(d2l_workdir, bad_inputs, args, message):
  before = sorted(p.name for p in bad_inputs.iterdir())
  result = _cli("--workdir", str(d2l_workdir), *[a.format(d=bad_inputs) for a in args])
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message.format(d=bad_inputs)}")
  assert "Traceback" not in result.stderr and result.stdout == ""
  assert sorted(p.name for p in bad_inputs.iterdir()) == before


def test_a_long_source_is_translated_sentence_by_sentence(d2l_workdir, tmp_path):
  # 19 tokens with <eos>: over --segment_over's 16, and over d2l_tiny's max_len of 9.
  (tmp_path / "in.txt").write_text("I lost. I'm home. I'm calm. I lost. I'm calm. I'm home.\n"
                                   "\nI'm home.\n")
  args = ["--workdir", str(d2l_workdir), "--input", str(tmp_path / "in.txt"), "--beam_size", "1",
          "--batch_size", "4"]
  result = _cli(*args)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines() == [
      "j'ai perdu . je suis chez moi . je suis calme . j'ai perdu . je suis calme . "
      "je suis chez moi .", "", "je suis chez moi ."]
  assert "truncated" not in result.stderr
  # --segment_over -1: no sentence splitting, but nothing cut off either: the line is over the
  # model's 9 tokens, so it is translated in runs of words that fit, every word of it read.
  whole = _cli(*args, "--segment_over", "-1")
  assert whole.returncode == 0, whole.stderr[-2000:]
  assert "1 of 3 sources have more tokens than the model's 9 (data.max_len)" in whole.stderr
  assert "truncated" not in whole.stderr
  assert whole.stdout.splitlines()[1:] == ["", "je suis chez moi ."]
  assert len(whole.stdout.splitlines()[0].split()) >= 12


def test_long_sources_are_decoded_with_the_long_beam(d2l_workdir, fra_eng_builder, tmp_path):
  from transformer_jax.data import sources
  from transformer_jax.decoding.lines import translate_lines
  translator = Translator(d2l_workdir)
  lines = [s for s, _ in sources.pairs(fra_eng_builder, "fra_eng", "validation[:160]")]
  over = 4  # Beam 4 and greedy differ on some of these of 4 tokens (with <eos>) and of 5.
  is_long = [len(ids) + 1 > over for ids in translator.tokenizers.src.encode(lines)]
  short = [x for x, k in zip(lines, is_long) if not k]
  long = [x for x, k in zip(lines, is_long) if k]
  greedy, beam = DecodeOptions(beam_size=1), DecodeOptions(beam_size=4)
  out = translate_lines(translator, lines, greedy, 16, progress=False, long_beam=(over, 4))
  # Each group translated on its own, with its options, in the same batches.
  by_group = {False: iter(translate_lines(translator, short, greedy, 16, progress=False)),
              True: iter(translate_lines(translator, long, beam, 16, progress=False))}
  assert out == [next(by_group[k]) for k in is_long]
  # The choice shows: this holds for neither beam applied to every line.
  assert out != translate_lines(translator, lines, greedy, 16, progress=False)
  assert out != translate_lines(translator, lines, beam, 16, progress=False)
  # The command: beam 4, and greedy (beam 1) for the long ones.
  (tmp_path / "in.txt").write_text("".join(x + "\n" for x in lines))
  result = _cli("--workdir", str(d2l_workdir), "--input", str(tmp_path / "in.txt"),
                "--batch_size", "16", "--beam_size", "4", "--long_beam_size", "1",
                "--long_over", str(over))
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines() == translate_lines(translator, lines, beam, 16,
                                                       progress=False, long_beam=(over, 1))


def test_empty_lines_translate_to_empty_lines_in_place(d2l_workdir, tmp_path):
  long = "I lost " + "very " * 20 + "much."  # Line 5: over the model's 9 tokens.
  (tmp_path / "in.txt").write_text(f"I lost.\n\n   \nI'm home.\n{long}\n")
  result = _cli("--workdir", str(d2l_workdir), "--input", str(tmp_path / "in.txt"),
                "--beam_size", "1", "--batch_size", "4")
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[:4] == ["j'ai perdu .", "", "", "je suis chez moi ."]
  assert len(result.stdout.splitlines()) == 5
  # Cut to fit and translated in pieces, not truncated: every word of it is read.
  assert "1 of 5 sources have more tokens than the model's 9" in result.stderr
  assert "truncated" not in result.stderr
  assert len(result.stdout.splitlines()[4].split()) > 9


def test_visualize_refuses_an_out_that_is_a_file(d2l_workdir, tmp_path):
  (tmp_path / "taken").write_text("keep me")
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "visualize", "--workdir",
                           str(d2l_workdir), "--out", str(tmp_path / "taken"), "I lost."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: --out {tmp_path / 'taken'} is a file; it must name a directory")
  assert (tmp_path / "taken").read_text() == "keep me"


def test_missing_checkpoint_and_corrupt_tokenizer(d2l_workdir, tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(WorkdirError, match="no config.json"):
    Translator(empty)
  broken = tmp_path / "broken"
  shutil.copytree(d2l_workdir, broken)
  (broken / "vocab.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"vocab.json is damaged or empty"):
    Translator(broken)
  shutil.rmtree(broken / "checkpoints")
  (broken / "vocab.json").write_text((d2l_workdir / "vocab.json").read_text())
  with pytest.raises(WorkdirError, match="no checkpoints"):
    Translator(broken)


def test_overlong_sentence_is_truncated_with_a_warning(d2l_workdir, caplog):
  translator = Translator(d2l_workdir)
  long = "I lost " + "very " * 20 + "much."
  # A batch padded with copies of sentence 3 (as translate_lines pads) warns of it once.
  out = translator.translate([long, long, "I lost."], DecodeOptions(beam_size=1),
                             numbers=[3, 3, 4])
  assert len(out) == 3 and out[0] == out[1]
  assert [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()] == [
      "sentence 3 has 25 tokens; truncated to the model's 9"]


def test_d2l_bleu_matches_the_chapters_definition():
  assert metrics.d2l_bleu("je suis calme .", "je suis calme .") == 1.0
  # 2 of 4 unigrams and 1 of 3 bigrams match; no brevity penalty.
  np.testing.assert_allclose(metrics.d2l_bleu("il est calme .", "je suis calme ."),
                             (2 / 4) ** 0.5 * (1 / 3) ** 0.25)
  assert metrics.d2l_bleu("", "je") == 0.0


def test_visualize_writes_heatmaps_per_layer(d2l_workdir, tmp_path):
  from transformer_jax.decoding import heatmaps as visualize
  translator = Translator(d2l_workdir)
  src_tokens, tgt_tokens, maps = visualize.attention_maps(translator, "I'm home.")
  assert src_tokens == ["i'm", "home", ".", "<eos>"]
  assert tgt_tokens == ["<bos>", "je", "suis", "chez", "moi", "."]
  assert sorted(maps) == [(k, layer) for k in ("cross", "decoder", "encoder") for layer in (0, 1)]
  assert maps["cross", 0].shape == (4, 6, 4)  # [heads, target, source]
  np.testing.assert_allclose(maps["cross", 1].sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.triu(maps["decoder", 0], 1), 0.0, atol=1e-7)  # causal
  paths = visualize.plot(maps, src_tokens, tgt_tokens, tmp_path / "maps")
  assert sorted(p.name for p in paths) == sorted(
      f"{k}_layer{layer}.png" for k in ("encoder", "decoder", "cross") for layer in (1, 2))
  assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_translate_decodes_with_the_workdirs_own_settings_unless_a_flag_overrides(d2l_workdir,
                                                                                tmp_path):
  """The config's decode section, saved in config.json, gives translate's defaults; a workdir
  written before the section existed gets base_config's."""
  from configs import fra_eng
  from transformer_jax import config as config_lib
  recipe = fra_eng.get_config()
  assert config_lib.parse(recipe).decode == config_lib.DecodeConfig(
      beam_size=4, alpha=1.0, segment_over=16, long_beam_size=0, long_over=16)
  older = tmp_path / "older"
  older.mkdir()
  saved = json.loads((d2l_workdir / "config.json").read_text())
  saved.pop("decode")
  (older / "config.json").write_text(json.dumps(saved))
  assert Workdir(older).load_config().decode == config_lib.DecodeConfig()

  greedy = tmp_path / "greedy"
  shutil.copytree(d2l_workdir, greedy)
  saved = json.loads((greedy / "config.json").read_text())
  saved["decode"].update(beam_size=1, alpha=0.0)
  (greedy / "config.json").write_text(json.dumps(saved))
  sentences = ["I lost.", "I'm home.", "Go now."]
  by_config = _cli("--workdir", str(greedy), *sentences)
  by_flags = _cli("--workdir", str(d2l_workdir), "--beam_size", "1", "--alpha", "0", *sentences)
  assert by_config.returncode == by_flags.returncode == 0, by_config.stderr[-1000:]
  assert by_config.stdout == by_flags.stdout and len(by_config.stdout.splitlines()) == 3
  # A flag wins over the workdir's setting: --long_beam_size needs the beam the flag asks for.
  refused = _cli("--workdir", str(greedy), "--long_beam_size", "4", "Go.")
  assert refused.stderr.strip().splitlines()[-1] == (
      "error: --long_beam_size needs beam search: --beam_size 1 decodes greedily")
  assert _cli("--workdir", str(greedy), "--beam_size", "2", "--long_beam_size", "4",
              "Go.").returncode == 0
