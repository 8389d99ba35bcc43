"""Checkpoint averaging: a new workdir whose checkpoint holds the mean of the parameters of a
workdir's last N checkpoints (the paper averages the last 5 checkpoints of base, 20 of big).

  python -m transformer_jax average --workdir runs/fra_eng --last 3 --output runs/fra_eng_avg3
  python -m transformer_jax translate --workdir runs/fra_eng_avg3 "Hello."

The new checkpoint is an ordinary one of the newest step, so that `translate` restores it like
any other (and `train.py` could go on from it): the averaged parameters (and moving averages,
where the run kept them); the rest of the state (optimizer moments, step, dropout key) and the
data position of the newest checkpoint; the workdir's config.json and tokenizer files. Every averaged checkpoint is verified against its
fingerprints first. Nothing half-written is left: the new workdir is built in a new directory
beside OUTPUT (`.OUTPUT.partial-XXXX`, never one that exists) and renamed when complete.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
from absl import logging

from transformer_jax import checkpoint, errors, fs, sharding
from transformer_jax.training import steps as step_lib
from transformer_jax.errors import UserError
from transformer_jax.runs.restore import Opened, open_run
from transformer_jax.runs.workdir import Workdir, check_outside_runs


class AverageError(UserError, ValueError):
  """The workdir, the checkpoint count or the output cannot be averaged or written."""


def state_of(run: Opened):
  """(train state, its shardings) of the kind a workdir's checkpoints hold, on this machine's
  devices: what to restore them into."""
  config = run.config
  return step_lib.create_train_state(
      run.model, step_lib.make_optimizer(config.optimizer, config.run.num_steps, run.model),
      config.run.seed, sharding.make_mesh((-1, 1, 1)), config.data.max_len,
      ema=config.eval_params_kept)


# Tries at reading a consistent set of the newest checkpoints while a live run rotates them.
READS = 5


def _rotated_away(source_dir: Workdir, step: int, last: int) -> bool:
  """Whether a live run removed (or is removing) the checkpoint of `step`: it is no longer one
  of the newest `last` present. A removal in progress leaves its directory a moment, and the
  run removes an old one only after writing a newer one, so the newest are checked a second on."""
  time.sleep(1.0)
  return step not in source_dir.checkpoint_steps()[-last:]


def _sum_of_last(source_dir: Workdir, last: int, state_like, shardings):
  """(steps, sum of (params, ema_params), the last state, its data position) of the newest
  `last` checkpoints; None where a run writing the workdir removed one of them as it was read
  (its checkpoints rotate: keep_checkpoints), so that the caller reads the newest again."""
  source = source_dir.checkpointer(read_only=True)
  steps = sorted(source.manager.all_steps())[-last:]
  total = None
  try:
    if len(steps) < last:
      raise AverageError(f"--last {last}: {source_dir.checkpoints} holds {len(steps)} "
                         f"checkpoints ({steps or 'none'})")
    for step in steps:
      state, data = source.restore(step, state_like, shardings)
      source.verify(step, state)
      both = (state.params, state.ema_params)  # ema_params: None where the run kept none.
      total = both if total is None else jax.tree.map(jax.numpy.add, total, both)
      logging.info("Read the checkpoint of step %d", step)
  except (checkpoint.CheckpointMismatchError, AverageError):
    raise
  except Exception as e:
    if source_dir.writer() is not None and _rotated_away(source_dir, step, last):
      logging.info("step %d was removed as it was read (%s is training): reading the newest "
                   "%d again", step, source_dir.writer(), last)
      return None
    raise AverageError(f"the checkpoint of step {step} in {source_dir.checkpoints} cannot be "
                       f"averaged: {errors.first_line(e)}") from None
  finally:
    source.close()
  return steps, total, state, data


def average_checkpoints(workdir: str | Path, last: int, output: str | Path) -> list[int]:
  """Writes the workdir `output` with the mean parameters of `workdir`'s last `last`
  checkpoints; returns the averaged steps."""
  source_dir, output = Workdir(workdir), Path(output)
  if last < 1:
    raise AverageError(f"--last must be at least 1, got {last}")
  if output.exists():
    raise AverageError(f"{output} exists; name a new directory for the averaged workdir")
  check_outside_runs(output, "--output")
  source_dir.load_config()  # Raises first where the workdir is none.
  fs.check_writable(output, "--output")
  run = open_run(source_dir)
  state_like, shardings = state_of(run)
  for _ in range(READS):
    read = _sum_of_last(source_dir, last, state_like, shardings)
    if read is not None:
      break
  else:
    writer = source_dir.writer() or "the run that held its writer.lock"
    now = ", ".join(map(str, source_dir.checkpoint_steps())) or "none"
    raise AverageError(f"{source_dir.checkpoints} is being written by {writer}, "
                       f"which removed checkpoints as they were read, {READS} times (its "
                       f"checkpoints now: {now}): average when that run has stopped")
  steps, total, state, data = read
  params, ema_params = jax.tree.map(lambda x: x / len(steps), total)
  averaged = state.replace(params=params, ema_params=ema_params)

  with fs.new_directory(output) as partial:
    source_dir.copy_run_files(partial, run.tokenizers)
    (partial / "averaged_from.json").write_text(json.dumps(
        {"workdir": str(source_dir.path.absolute()), "steps": steps}, indent=2))
    target = Workdir(partial).checkpointer()
    target.save(steps[-1], averaged, data, force=True)
    target.close()
  return steps
