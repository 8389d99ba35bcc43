"""Checkpoint averaging: the mean of the real checkpoints' parameters, restored like any
checkpoint, and one-line errors that write nothing."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.conftest import ROOT
from transformer_jax import checkpoint
from transformer_jax.runs.restore import open_run
from transformer_jax.runs.workdir import Workdir, WorkdirError
from transformer_jax.training.average import AverageError, average_checkpoints, state_of
from transformer_jax.decoding.translator import Translator


def _states(config, workdir, steps):
  """{step: (state, data)} read back through the library's own restore."""
  state, shardings = state_of(open_run(Workdir(workdir)))
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", 1, 1, read_only=True)
  try:
    return {s: jax.device_get(ckpt.restore(s, state, shardings)) for s in steps}
  finally:
    ckpt.close()


def test_averaged_parameters_are_the_mean_of_the_last_checkpoints(trained, tmp_path):
  config, workdir = trained
  output = tmp_path / "avg"
  assert average_checkpoints(workdir, 2, output) == [10, 20]
  sources = _states(config, workdir, [10, 20])
  (averaged, data), = _states(config, output, [20]).values()
  newest, newest_data = sources[20]
  for key in ("params", "ema_params"):  # The run kept a moving average: averaged too.
    flat = [jax.tree.leaves(getattr(state, key)) for state, _ in sources.values()]
    for got, *each in zip(jax.tree.leaves(getattr(averaged, key)), *flat):
      np.testing.assert_allclose(got, np.mean(np.stack(each), axis=0, dtype=np.float64),
                                 rtol=1e-6, atol=1e-7)
    # Not a copy of one of them: the checkpoints differ and the mean is between them.
    assert any(not np.array_equal(a, b) for a, b in zip(flat[0], flat[1]))
  # Everything else is the newest checkpoint's, bit for bit.
  for got, want in zip(jax.tree.leaves(averaged.opt_state), jax.tree.leaves(newest.opt_state)):
    np.testing.assert_array_equal(got, want)
  assert int(averaged.step) == 20 and data == newest_data
  # translate restores it like any other checkpoint (fingerprints verified): the averaged
  # moving average by default, the averaged parameters with ema=False.
  for ema, key in ((True, "ema_params"), (False, "params")):
    translator = Translator(output, ema=ema)
    assert translator.step == 20 and translator.uses_ema == ema
    for got, want in zip(jax.tree.leaves(translator.params),
                         jax.tree.leaves(getattr(averaged, key))):
      np.testing.assert_array_equal(np.asarray(got), want)
  assert len(translator.translate(["Go."])) == 1


def test_bad_requests_are_one_line_and_write_nothing(trained, tmp_path):
  _, workdir = trained
  with pytest.raises(AverageError, match=r"--last 3: .* holds 2 checkpoints \(\[10, 20\]\)"):
    average_checkpoints(workdir, 3, tmp_path / "a")
  with pytest.raises(WorkdirError, match="not a training workdir"):
    average_checkpoints(tmp_path, 2, tmp_path / "b")
  (tmp_path / "exists").mkdir()
  with pytest.raises(AverageError, match="exists; name a new directory"):
    average_checkpoints(workdir, 2, tmp_path / "exists")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]
  # Inside the run it reads (or any run): a checkpoint-shaped folder there is the run's to judge.
  before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  for inside in (workdir / "checkpoints" / "30", workdir / "averaged"):
    with pytest.raises(WorkdirError) as error:
      average_checkpoints(workdir, 2, inside)
    assert str(error.value) == (f"--output {inside} is inside the workdir {workdir.resolve()}: "
                                "name a directory outside it (its files are the run's)")
    assert not inside.exists()
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
  result = subprocess.run(
      [sys.executable, "-m", "transformer_jax", "average", "--workdir", str(workdir), "--last", "0",
       "--output", str(tmp_path / "c")], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == "error: --last must be at least 1, got 0"
  assert not (tmp_path / "c").exists()


def test_a_checkpoint_that_fails_to_read_is_one_line_and_the_last(trained, tmp_path):
  """A data file gone from step 20 (as a run's rotation removes it mid-read): `average` exits 1
  with one line naming the step, and the other reads abandoned with it echo nothing after."""
  import shutil
  from tests.system.test_reliability import _damage
  _, source = trained
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  _damage(workdir / "checkpoints" / "20", "deleted chunk", every_chunk=True)
  result = subprocess.run(
      [sys.executable, "-m", "transformer_jax", "average", "--workdir", str(workdir), "--last",
       "2", "--output", str(tmp_path / "a")], cwd=ROOT, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 1, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: the checkpoint of step 10 in {workdir / 'checkpoints'} cannot "
                         "be averaged: ") or last.startswith(
      f"error: the checkpoint of step 20 in {workdir / 'checkpoints'} cannot be averaged: "), last
  assert "TensorStore details" not in last
  for echo in ("Event loop is closed", "Traceback", "never retrieved", "never awaited"):
    assert echo not in result.stderr, result.stderr[-2000:]
  assert not (tmp_path / "a").exists()


def test_averaging_a_run_that_is_still_training_reads_its_newest_checkpoints(trained, tmp_path):
  """A live run keeps 2 checkpoints, one every 25 steps: each `average --last 2` beside it
  exits 0 with two checkpoints 25 steps apart that the run wrote (a step rotated away as it was
  read is read again from the newest), or, where the run rotates them faster than they read,
  says so in one line naming the writer; never a "damaged" error."""
  import json
  import re
  import shutil
  import socket
  import time
  from tests.system.test_user_mistakes import _train_args
  config, source = trained
  workdir = tmp_path / "live"
  shutil.copytree(source, workdir)
  train = subprocess.Popen(
      [sys.executable, *_train_args(config, workdir, num_steps=100000),
       "--config.run.checkpoint_every=25", "--config.run.keep_checkpoints=2",
       "--config.run.log_every=5", "--config.eval.every=100000"],
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while max(Workdir(workdir).checkpoint_steps()) < 75:  # Resumed at 20, rotating now.
      assert train.poll() is None and time.monotonic() < deadline, train.stderr.read()[-2000:]
      time.sleep(0.5)
    averaged = 0
    for i in range(3):
      out = tmp_path / f"avg{i}"
      result = subprocess.run(
          [sys.executable, "-m", "transformer_jax", "average", "--workdir", str(workdir),
           "--last", "2", "--output", str(out)], cwd=ROOT, capture_output=True, text=True,
          timeout=300)
      if result.returncode == 1:  # It rotated faster than they could be read, every try.
        assert re.fullmatch(
            re.escape(f"error: {workdir / 'checkpoints'} is being written by process "
                      f"{train.pid} on {socket.gethostname()}, which removed checkpoints as "
                      "they were read, 5 times (its checkpoints now: ") + r"\d+(, \d+)*"
            + re.escape("): average when that run has stopped"),
            result.stderr.strip().splitlines()[-1]), result.stderr[-2000:]
        assert not out.exists()
        continue
      assert result.returncode == 0, result.stderr[-2000:]
      steps = json.loads((out / "averaged_from.json").read_text())["steps"]
      assert steps[1] - steps[0] == 25 and steps[0] >= 25 and steps[0] % 25 == 0, steps
      assert Workdir(out).checkpoint_steps() == [steps[1]]
      averaged += 1
    assert averaged, "every average beside the run gave up"
    assert train.poll() is None  # The run went on beside it.
  finally:
    train.kill()
    train.wait()
