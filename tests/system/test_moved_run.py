"""A trained run is self-contained: trained with a relative data path, then moved to another
folder, every command that reads it works from a third current directory, and only the trainer
asks for the corpus again (in one line naming the field and its override)."""

import http.client
import os
import shutil
import subprocess
import sys

import portpicker
import pytest

from benchmarks.serve_load import post, start_server, stop_server, wait_ready
from tests.conftest import DATA, ROOT

SENTENCES = ["I lost.", "I'm home."]


@pytest.fixture(scope="module")
def moved(tmp_path_factory, tfds_dir, cache_dir):
  """A 4-step smoke run trained from the repository's root with `data.data_dir` relative to it,
  moved to another folder once trained; the current directory for its commands: an empty third
  one, from which that relative path names nothing."""
  tmp = tmp_path_factory.mktemp("moved")
  relative = os.path.relpath(DATA / "fra-eng", ROOT)
  trained_at = tmp / "trained_here" / "run"
  subprocess.run(
      [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke", "--workdir",
       str(trained_at), f"--config.data.data_dir={relative}", f"--config.data.tfds_dir={tfds_dir}",
       f"--config.run.compilation_cache_dir={cache_dir}", "--config.data.num_workers=0",
       "--config.run.num_steps=4", "--config.run.checkpoint_every=2",
       "--config.eval.bleu_sentences=0"],
      cwd=ROOT, check=True, capture_output=True, timeout=600)
  workdir = tmp / "copied_to" / "run"
  shutil.move(trained_at.parent, workdir.parent)
  elsewhere = tmp / "elsewhere"
  elsewhere.mkdir()
  assert f'"data_dir": "{relative}"' in (workdir / "config.json").read_text()
  assert not (elsewhere / relative).exists()
  return workdir, elsewhere, relative


def _command(cwd, *args):
  result = subprocess.run([sys.executable, "-m", "transformer_jax", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert "damaged" not in result.stderr, result.stderr[-2000:]
  return result


def _ok(cwd, *args):
  result = _command(cwd, *args)
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout


def test_translate_and_average(moved):
  workdir, elsewhere, _ = moved
  translations = _ok(elsewhere, "translate", "--workdir", workdir, *SENTENCES).splitlines()
  assert len(translations) == 2
  _ok(elsewhere, "average", "--workdir", workdir, "--last", "2", "--output", "avg")
  assert (elsewhere / "avg" / "checkpoints").is_dir()
  assert len(_ok(elsewhere, "translate", "--workdir", "avg", *SENTENCES).splitlines()) == 2


def test_export_and_visualize(moved):
  workdir, elsewhere, _ = moved
  _ok(elsewhere, "export", "--workdir", workdir, "--to", "ctranslate2", "ct2")
  assert (elsewhere / "ct2" / "model.bin").is_file()
  _ok(elsewhere, "visualize", "--workdir", workdir, "--out", "maps", SENTENCES[0])
  assert (elsewhere / "maps" / "cross_layer1.png").is_file()


def test_serve(moved, tmp_path):
  workdir, elsewhere, _ = moved
  expected = _ok(elsewhere, "translate", "--workdir", workdir, "--beam_size", "1",
                 *SENTENCES).splitlines()
  port = portpicker.pick_unused_port()
  with open(tmp_path / "serve.log", "w") as log:
    server = start_server(str(workdir), port, "--slots=auto", log=log, cwd=elsewhere)
    try:
      wait_ready(server, port, timeout=600)
      connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
      status, body, _ = post(connection, {"sentences": SENTENCES, "beam_size": 1})
    finally:
      assert stop_server(server) == 0, (tmp_path / "serve.log").read_text()[-3000:]
  assert status == 200, body
  assert [t["text"] for t in body["translations"]] == expected


def test_only_the_trainer_and_a_split_ask_for_the_corpus(moved):
  """Resuming from where the relative path names nothing is one line naming the field and the
  override, with nothing written; `translate --split` reads the corpus, and says which."""
  workdir, elsewhere, relative = moved
  before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
  result = subprocess.run(
      [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/fra_eng.py:smoke"),
       "--workdir", str(workdir), f"--config.data.data_dir={relative}",
       "--config.run.num_steps=6"], cwd=elsewhere, capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: data.data_dir={relative!r} is not a directory from {elsewhere}: pass the "
      "corpus's directory with --config.data.data_dir DIR (a run moved since it was trained "
      "keeps the path it was given then)")
  assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before
  split = _command(elsewhere, "translate", "--workdir", workdir, "--split", "validation")
  assert split.returncode == 1 and "data_dir=" in split.stderr.strip().splitlines()[-1]
