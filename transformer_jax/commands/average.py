"""A new workdir with the mean parameters of a workdir's last N checkpoints.

  python -m transformer_jax average --workdir runs/fra_eng --last 3 --output runs/fra_eng_avg3
"""

from __future__ import annotations

from absl import app, flags

from transformer_jax import errors
from transformer_jax.commands import launch
from transformer_jax.training.average import AverageError, average_checkpoints


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir.")
  flags.DEFINE_integer("last", 5, "How many of its newest checkpoints to average.")
  flags.DEFINE_string("output", None, "The new workdir to write (must not exist).")


def main(argv):
  FLAGS = flags.FLAGS
  with errors.reported():
    if len(argv) > 1:
      raise AverageError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.workdir or not FLAGS.output:
      raise AverageError("--workdir and --output are required")
    steps = average_checkpoints(FLAGS.workdir, FLAGS.last, FLAGS.output)
  print(f"Averaged the parameters of steps {steps} of {FLAGS.workdir} into {FLAGS.output} "
        f"(a checkpoint of step {steps[-1]})")


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
