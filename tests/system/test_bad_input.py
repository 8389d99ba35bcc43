"""Bad input to train.py: one `error:` line that names the field, file or line, raised before
anything is prepared, compiled or written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import pytest

from transformer_jax import config as config_lib
from transformer_jax.training import steps as step_lib, trainer
from transformer_jax.runs.workdir import WorkdirError
from tests import runs
from tests.conftest import DATA, ROOT, xla_flags
from transformer_jax.data import builders
from transformer_jax.data.builders import DatasetError
from transformer_jax.data.tokenizer import TokenizerError


def _cli(*args, devices=1):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"))
  return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,devices,message", [
    (["--config.data.batch_size=6", "--config.run.mesh_shape=(4,1,1)"], 4,
     "error: data.batch_size=6 does not split over the mesh's 4 data-parallel devices"),
    (["--config.data.batch_size=8", "--config.step.grad_accum_steps=4",
      "--config.run.mesh_shape=(4,1,1)"],
     4, "error: data.batch_size=8 / step.grad_accum_steps=4 = 2 rows a microbatch do not split "
     "over the mesh's 4 data-parallel devices"),
    (["--config.run.mesh_shape=(8,1,1)"], 1,
     "error: run.mesh_shape (8, 1, 1) needs 8 devices, found 1 (cpu)"),
])
def test_cli_errors_are_one_line_and_write_nothing(tmp_path, tfds_dir, args, devices, message):
  workdir = tmp_path / "run"
  result = _cli("--config", "configs/fra_eng.py:smoke", "--workdir", str(workdir),
                f"--config.data.data_dir={DATA / 'fra-eng'}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}", *args, devices=devices)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(message), result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  assert not workdir.exists() and not (tmp_path / "tfds").exists()


def test_unknown_config_field_is_named(tmp_path):
  result = _cli("--config", "configs/fra_eng.py:smoke", "--workdir", str(tmp_path / "w"),
                "--config.bogus=1")
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      "error: --config.bogus: no such config field (the fields and their meanings are in "
      "transformer_jax/config.py)"]
  result = _cli("--config", "configs/fra_eng.py:smoke", "--workdir", str(tmp_path / "w"),
                "--config.num_steps=3")  # A field of the config before it had sections.
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      "error: --config.num_steps: no such config field; it is --config.run.num_steps (the "
      "fields and their meanings are in transformer_jax/config.py)"]
  result = _cli("--config", "configs/fra_eng.py:smoke", "--workdir", str(tmp_path / "w"),
                "--config.model.d_modle=64")  # A misspelled field: the flag and the guess.
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      "error: --config.model.d_modle: no such config field; did you mean --config.model.d_model? "
      "(the fields and their meanings are in transformer_jax/config.py)"]
  assert not (tmp_path / "w").exists()


def test_empty_workdir_flag(tmp_path):
  result = _cli("--config", "configs/fra_eng.py:smoke", "--workdir=")
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      "error: --workdir is empty; name a directory for the run")


@pytest.mark.parametrize("change,message", [
    (dict(model=dict(num_heads=0)), "model.num_heads=0 must be a positive integer"),
    (dict(optimizer=dict(grad_clip=-1.0)), "optimizer.grad_clip=-1.0 must be >= 0"),
    (dict(optimizer=dict(warmup_steps=-5)), "optimizer.warmup_steps=-5 must be >= 0"),
    (dict(run=dict(nonfinite="ignore")), "run.nonfinite='ignore' must be 'stop' or 'skip'"),
    (dict(data=dict(batch_size=0)), "data.batch_size=0 must be a positive integer"),
    (dict(step=dict(grad_accum_steps=3)),
     "step.grad_accum_steps=3 must divide data.batch_size=16"),
    (dict(step=dict(loss_chunks=5)), "step.loss_chunks=5 must divide data.max_len=32"),
    (dict(data=dict(dataset="wmt99")), "data.dataset='wmt99' is unknown"),
    (dict(step=dict(ema_decay=1.0)),
     "step.ema_decay=1.0 must be in [0, 1) (0: no moving average)"),
    (dict(data=dict(concat_prob=-0.1)),
     "data.concat_prob=-0.1 must be in [0, 1) (0: no concatenation)"),
    (dict(data=dict(concat_max=0)), "data.concat_max=0 must be at least 1 (pairs)"),
])
def test_bad_config_values_are_named(smoke_config, tmp_path, change, message):
  smoke_config.update(change)
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_zero_grad_clip_means_no_clipping_and_zero_warmup_means_none():
  import jax.numpy as jnp
  import optax
  cfg = step_lib.OptimizerConfig(grad_clip=0.0, warmup_steps=0, learning_rate=1e-3,
                                  schedule="rsqrt")
  tx = step_lib.make_optimizer(cfg, num_steps=100)
  params = {"w": jnp.ones(3)}
  updates, _ = tx.update({"w": jnp.full(3, 100.0)}, tx.init(params), params)
  assert float(jnp.abs(updates["w"]).max()) > 0  # Gradients are not zeroed.
  schedule = step_lib.learning_rate_schedule(cfg, num_steps=100)
  assert float(schedule(0)) == pytest.approx(1e-3) and float(schedule(3)) == pytest.approx(5e-4)
  clipped = step_lib.make_optimizer(step_lib.OptimizerConfig(grad_clip=1.0), num_steps=100)
  assert isinstance(clipped.init(params), tuple) and optax  # Same state structure either way.
  assert len(clipped.init(params)) == len(tx.init(params))


def test_workdir_that_is_a_file(smoke_config, tmp_path):
  (tmp_path / "file").write_text("not a directory")
  with pytest.raises(WorkdirError, match="--workdir .*file is a file"):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "file"))
  assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.parametrize("content,message", [
    (b"", r"fra.txt holds no 'English<TAB>French' line"),
    (b"Go.  Va !\nHi.  Salut !\n", r"fra.txt holds no 'English<TAB>French' line"),
    (b"Go.\tVa !\nI\xe9t\xe9.\tJ'ai \xe9t\xe9.\n", r"fra.txt line 2 is not UTF-8 text \(byte 2"),
])
def test_bad_corpus_files_are_named_by_line(smoke_config, tmp_path, content, message):
  data = tmp_path / "data"
  data.mkdir()
  (data / "fra.txt").write_bytes(content)
  smoke_config.data.update(data_dir=str(data), tfds_dir=str(tmp_path / "tfds"))
  with pytest.raises(DatasetError, match=message):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
  assert not list((tmp_path / "tfds").rglob("dataset_info.json"))


def test_a_corrupt_zip_is_named(smoke_config, tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  (data / "fra-eng.zip").write_bytes(b"PK\x03\x04 not really a zip")
  smoke_config.data.update(data_dir=str(data), tfds_dir=str(tmp_path / "tfds"))
  with pytest.raises(DatasetError, match="fra-eng.zip is not a readable zip file"):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  with zipfile.ZipFile(data / "fra-eng.zip", "w") as zf:
    zf.writestr("fra-eng/readme.txt", "no corpus here")
  with pytest.raises(DatasetError, match="fra-eng.zip holds no fra.txt"):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))


@pytest.mark.parametrize("split,message", [
    ("valid", r"split 'valid' of fra_eng cannot be read: Unknown split 'valid'"),
    ("validation[:0]", r"split 'validation\[:0\]' of fra_eng holds no pairs$"),
    ("train[:0]", r"split 'train\[:0\]' of fra_eng holds no pairs$"),  # array_record's words before.
])
def test_a_bad_split_is_named(smoke_config, tmp_path, split, message):
  setattr(smoke_config.data, "train_split" if split.startswith("train") else "eval_split", split)
  with pytest.raises(DatasetError, match=message):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_no_data_dir_and_an_unreachable_source_fails_fast(smoke_config, tmp_path, monkeypatch):
  url = "http://127.0.0.1:9/fra-eng.zip"  # Nothing listens on port 9.
  monkeypatch.setattr(builders, "FRA_ENG_URL", url)
  smoke_config.data.update(data_dir="", tfds_dir=str(tmp_path / "tfds"))
  with pytest.raises(DatasetError, match="fra_eng is not prepared in tfds_dir and its source "
                     f"{url} cannot be reached"):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_a_source_that_answers_404_is_one_line(smoke_config, tmp_path, monkeypatch):
  """A download URL that answers an HTTP error (a moved file) is named with the error before
  tfds tries it (an 85-line traceback before)."""
  import http.server
  import threading

  class Gone(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 (http.server's naming)
      self.send_error(404)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gone)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    url = f"http://127.0.0.1:{server.server_port}/fra-eng.zip"
    monkeypatch.setattr(builders, "FRA_ENG_URL", url)
    smoke_config.data.update(data_dir="", tfds_dir=str(tmp_path / "tfds"))
    with pytest.raises(DatasetError) as raised:
      trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  finally:
    server.shutdown()
  assert str(raised.value) == (f"dataset fra_eng is not prepared in tfds_dir and its source {url} "
                               "answered 404 Not Found; set data_dir to a directory with its "
                               "raw files")
  assert not (tmp_path / "w").exists()


def _tree_hashes(root):
  import hashlib
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
          else "dir" for p in sorted(root.rglob("*"))}


def test_ctrl_c_during_a_download_exits_at_once_and_leaves_nothing(tmp_path):
  """A download that trickles: the first Ctrl-C ends train.py with its one line and status 130
  (it waited for tfds's download thread before), and tfds's partial files are gone."""
  import http.server
  import signal
  import threading
  import time
  asked = threading.Event()

  class Trickle(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 (http.server's naming)
      self.send_response(200)
      self.send_header("Content-Length", str(10 ** 8))
      self.end_headers()

    def do_GET(self):  # noqa: N802
      self.do_HEAD()
      asked.set()
      try:
        for _ in range(600):
          self.wfile.write(b"x" * 100)
          self.wfile.flush()
          time.sleep(0.5)
      except OSError:
        pass

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  tfds = tmp_path / "tfds"
  (tfds / "other").mkdir(parents=True)
  (tfds / "other" / "kept.txt").write_text("a user's file")
  before = _tree_hashes(tfds)
  script = ("import sys; from transformer_jax.data import builders; "
            f"builders.FRA_ENG_URL = 'http://127.0.0.1:{server.server_port}/fra-eng.zip'; "
            "from transformer_jax.commands import train; train.run()")
  process = subprocess.Popen(
      [sys.executable, "-c", script, "--config", "configs/fra_eng.py:smoke",
       "--workdir", str(tmp_path / "w"), "--config.data.data_dir=",
       f"--config.data.tfds_dir={tfds}"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True, preexec_fn=runs.sigint_at_its_default)
  try:
    assert asked.wait(120), "the download never started"
    time.sleep(1)  # Some bytes written into tfds's temporary file.
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)  # Before: held until the download ended.
  finally:
    process.kill()
    server.shutdown()
  assert process.returncode == 130
  assert stderr.splitlines()[-1] == ("error: interrupted before training started; nothing was "
                                     "saved. Run the same command to start again")
  assert "Traceback" not in stderr
  assert _tree_hashes(tfds) == before
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("content", [b"", b"\x00garbage that is not a sentencepiece model"])
def test_damaged_tokenizer_file_is_named(smoke_config, tmp_path, content):
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "tokenizer.model").write_bytes(content)
  with pytest.raises(TokenizerError, match=r"tokenizer.model is damaged or empty"):
    trainer.train_and_evaluate(smoke_config, str(workdir))
  assert sorted(p.name for p in workdir.iterdir()) == ["tokenizer.model"]


def test_schedule_free_with_a_moving_average_is_one_error(smoke_config, tmp_path):
  smoke_config.optimizer.update(name="schedule_free_adamw", schedule="constant")
  smoke_config.step.ema_decay = 0.99
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "step.ema_decay=0.99 and optimizer.name='schedule_free_adamw' both make the parameters "
      "evaluation reads: set step.ema_decay=0 (schedule-free already averages)")):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_warmup_stable_decay_holds_its_peak_then_falls_to_zero():
  cfg = step_lib.OptimizerConfig(schedule="wsd", learning_rate=1e-3, warmup_steps=10,
                                  decay_fraction=0.25)
  schedule = step_lib.learning_rate_schedule(cfg, num_steps=100)
  rates = [float(schedule(s)) for s in (5, 10, 50, 75, 90, 100)]
  assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 4e-4, 0.0])
