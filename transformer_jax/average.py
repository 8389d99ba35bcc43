"""Checkpoint averaging: a new workdir whose checkpoint holds the mean of the parameters of a
workdir's last N checkpoints (the paper averages the last 5 checkpoints of base, 20 of big).

  python -m transformer_jax.average --workdir runs/fra_eng --last 3 --output runs/fra_eng_avg3
  python -m transformer_jax.translate --workdir runs/fra_eng_avg3 "Hello."

The new checkpoint is an ordinary one of the newest step, so that `translate` restores it like
any other (and `train.py` could go on from it): the averaged parameters (and moving averages,
where the run kept them); the rest of the state (optimizer moments, step, dropout key) and the
data position of the newest checkpoint; the workdir's config.json and tokenizer files. Every averaged checkpoint is verified against its
fingerprints first. Nothing half-written is left: the new workdir is built under OUTPUT.tmp and
renamed when complete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import ml_collections
from absl import app, flags, logging

from transformer_jax import checkpoint, config as config_lib, fs, sharding, train_lib
from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.model import Transformer


class AverageError(ValueError):
  """The workdir, the checkpoint count or the output cannot be averaged or written."""


def state_of(config: ml_collections.ConfigDict, tokenizers: Tokenizers):
  """(train state, its shardings) of the kind a workdir's checkpoints hold, on this machine's
  devices: what to restore them into."""
  model = Transformer(config_lib.model_config(config, tokenizers.src.vocab_size,
                                              tokenizers.tgt.vocab_size))
  return train_lib.create_train_state(
      model, train_lib.make_optimizer(config_lib.optimizer_config(config)), config.seed,
      sharding.make_mesh((-1, 1, 1)), config.max_len, ema=config.get("ema_decay", 0) > 0)


def average_checkpoints(workdir: str | Path, last: int, output: str | Path) -> list[int]:
  """Writes the workdir `output` with the mean parameters of `workdir`'s last `last`
  checkpoints; returns the averaged steps."""
  workdir, output = Path(workdir), Path(output)
  if last < 1:
    raise AverageError(f"--last must be at least 1, got {last}")
  if output.exists():
    raise AverageError(f"{output} exists; name a new directory for the averaged workdir")
  try:
    config = config_lib.load_saved(workdir)
  except config_lib.ConfigError as e:
    raise AverageError(str(e)) from None
  fs.check_writable(output, "--output")
  tokenizers = Tokenizers.load(workdir)
  if tokenizers is None:
    raise AverageError(f"{workdir} holds no tokenizer (tokenizer.model or vocab.json)")
  source = checkpoint.Checkpointer(workdir / "checkpoints", 1, 1, read_only=True)
  steps = sorted(source.manager.all_steps())[-last:]
  if len(steps) < last:
    source.close()
    raise AverageError(f"--last {last}: {workdir / 'checkpoints'} holds {len(steps)} "
                       f"checkpoints ({steps or 'none'})")

  state_like, shardings = state_of(config, tokenizers)
  total = None
  try:
    for step in steps:
      state, data = source.restore(step, state_like, shardings)
      source.verify(step, state)
      both = (state.params, state.ema_params)  # ema_params: None where the run kept none.
      total = both if total is None else jax.tree.map(jax.numpy.add, total, both)
      logging.info("Read the checkpoint of step %d", step)
  except checkpoint.CheckpointMismatchError as e:
    raise AverageError(str(e)) from None
  except Exception as e:
    raise AverageError(f"the checkpoint of step {step} in {workdir / 'checkpoints'} cannot be "
                       f"averaged: {checkpoint.first_line(e)}") from None
  finally:
    source.close()
  params, ema_params = jax.tree.map(lambda x: x / len(steps), total)
  averaged = state.replace(params=params, ema_params=ema_params)

  partial = output.with_name(output.name + ".tmp")
  shutil.rmtree(partial, ignore_errors=True)  # Left by an earlier, interrupted run.
  partial.mkdir(parents=True)
  shutil.copy(workdir / "config.json", partial / "config.json")
  tokenizers.save(partial)
  (partial / "averaged_from.json").write_text(json.dumps(
      {"workdir": str(workdir.absolute()), "steps": steps}, indent=2))
  target = checkpoint.Checkpointer(partial / "checkpoints", 1, 1)
  target.save(steps[-1], averaged, data, force=True)
  target.close()
  partial.rename(output)
  return steps


def main(argv):
  if len(argv) > 1:
    sys.exit(f"error: unexpected arguments {argv[1:]}")
  FLAGS = flags.FLAGS
  try:
    if not FLAGS.workdir or not FLAGS.output:
      raise AverageError("--workdir and --output are required")
    steps = average_checkpoints(FLAGS.workdir, FLAGS.last, FLAGS.output)
  except AverageError as e:
    logging.get_absl_handler().flush()
    sys.exit(f"error: {e}")
  except OSError as e:
    logging.get_absl_handler().flush()
    sys.exit(f"error: {fs.describe(e)}")
  print(f"Averaged the parameters of steps {steps} of {FLAGS.workdir} into {FLAGS.output} "
        f"(a checkpoint of step {steps[-1]})")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training workdir.")
  flags.DEFINE_integer("last", 5, "How many of its newest checkpoints to average.")
  flags.DEFINE_string("output", None, "The new workdir to write (must not exist).")
  app.run(main)
