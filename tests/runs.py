"""train.py runs as the language-model tests start them: to the end, or killed (SIGKILL, with
its process group) once a step is logged, and their checkpoints and metrics read back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from tests.conftest import DATA, ROOT


def shakespeare_command(config: str, workdir, tfds_dir, cache_dir, *overrides: str) -> list[str]:
  """train.py on a config's smoke variant over the Shakespeare works (named relative to the
  repository's root, the command's current directory, as a user names them), in the tests' tfds
  directory and compilation cache, no grain workers; `overrides`: --config.X=V flags."""
  return [sys.executable, "train.py", "--config", f"configs/{config}.py:smoke",
          "--workdir", str(workdir),
          f"--config.data.data_dir={os.path.relpath(DATA / 'shakespeare', ROOT)}",
          f"--config.data.tfds_dir={tfds_dir}", f"--config.run.compilation_cache_dir={cache_dir}",
          "--config.data.num_workers=0", *overrides]


LM_STEPS = 16  # The shared smoke language model's (tests/conftest.py:lm_run).


def lm_command(workdir, tfds_dir, cache_dir, *extra: str) -> list[str]:
  """train.py on configs/lm_shakespeare.py:smoke for LM_STEPS steps, checkpoints every 4 and
  evaluation every 8: the shared smoke language model's command (and a resumed copy's)."""
  return shakespeare_command(
      "lm_shakespeare", workdir, tfds_dir, cache_dir, f"--config.run.num_steps={LM_STEPS}",
      "--config.run.log_every=1", "--config.run.checkpoint_every=4", "--config.eval.every=8",
      "--config.eval.num_batches=4", *extra)


def moved_copy(workdir: Path, tmp_path: Path) -> tuple[Path, Path]:
  """A copy of a trained run in another folder, and an empty current directory for commands on
  it, from which the run's relative data path names nothing."""
  copy = tmp_path / "moved" / workdir.name
  shutil.copytree(workdir, copy)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  data_dir = json.loads((copy / "config.json").read_text())["data"]["data_dir"]
  assert not Path(data_dir).is_absolute() and not (elsewhere / data_dir).exists(), data_dir
  return copy, elsewhere


def sigint_at_its_default() -> None:
  """A Popen `preexec_fn`: the child takes Ctrl-C as from a terminal. A test run started in the
  background of a shell (`.ci/run &`, nohup) has SIGINT ignored, which children inherit and
  which the product then leaves ignored (errors.note_interrupts): a Ctrl-C test's signal would
  be dropped."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(command: list[str]) -> str:
  """Runs `command` to its end (exit status 0); its stdout and stderr."""
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return proc.stdout + proc.stderr


def kill_after_step(command: list[str], step: int) -> None:
  """Starts `command` in its own process group and SIGKILLs the group once step `step`'s
  training line is logged."""
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  deadline = time.monotonic() + 300
  while not any(f"] [{step}] steps_per_sec" in line for line in lines):
    assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
    time.sleep(0.002)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  reader.join()


def records(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def assert_same_state(a: Path, b: Path, step: int) -> None:
  """The train states two workdirs saved at `step` are equal, array for array, bit for bit."""
  restore = lambda w: ocp.StandardCheckpointer().restore(w / "checkpoints" / str(step) / "state")
  x, y = jax.tree.leaves(restore(a)), jax.tree.leaves(restore(b))
  assert len(x) == len(y) > 0
  for u, v in zip(x, y):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
