"""Trains the Transformer: train --config configs/NAME.py[:ARG] --workdir DIR.

Re-running the same command with the same workdir resumes from the latest checkpoint; so does
`train --workdir DIR` alone, with the config the run saved (its config.json), which reads
nothing the config file read (a Hugging Face checkpoint the run started from).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer_jax import errors  # noqa: E402
from transformer_jax.commands import launch


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
  flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and the tokenizer.")
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0, for multi-host runs.")
  flags.DEFINE_integer("num_processes", 1, "Number of processes (one per host).")
  flags.DEFINE_integer("process_id", 0, "This process's index, 0 .. num_processes - 1.")
  flags.DEFINE_enum("distributed", "auto", ["auto", "off"],
                    "auto: without --num_processes, join the multi-process run of a cluster that "
                    "jax detects from the environment (SLURM, Cloud TPU, Kubernetes, Open MPI).")
  flags.DEFINE_integer("init_timeout", 300, "Several processes: seconds for all of them to join "
                       "the run (a loaded machine or a slow scheduler needs minutes).")
  flags.DEFINE_integer("heartbeat_timeout", 100, "Several processes: seconds without a "
                       "heartbeat after which the coordinator counts a process as dead.")


def main(argv):
  F = flags.FLAGS
  with errors.reported("interrupted before training started; nothing was saved. Run the same "
                       "command to start again"):
    if len(argv) > 1:
      raise errors.UserError(f"unexpected arguments {argv[1:]}")
    if F.workdir is None:
      raise errors.UserError("--workdir is required (and --config, for a new run)")
    config = F.config
    if config is None:  # A run resumed with its own config.json (nothing else is read again).
      from transformer_jax.runs.workdir import Workdir
      run = Workdir(F.workdir)
      if not run.config_file.is_file():
        raise errors.UserError(f"{F.workdir} holds no config.json of a run to resume: a new "
                               "run needs --config")
      config = run.load_config()
    # Orbax logs every save phase at INFO; keep the console to the trainer's own lines.
    logging.get_absl_handler().addFilter(lambda r: "/orbax/" not in r.pathname)
    for name in ("init_timeout", "heartbeat_timeout"):
      if getattr(F, name) < 1:
        raise errors.UserError(f"--{name}={getattr(F, name)} must be at least 1 (seconds)")
    launch.initialize_distributed(F.coordinator_address, F.num_processes, F.process_id,
                                  F.distributed, F.init_timeout, F.heartbeat_timeout)
    # jax and the data stack load after the flags parse.
    import jax
    from transformer_jax.training import goodput, trainer
    try:
      trainer.train_and_evaluate(config, F.workdir, started=goodput.process_start())
    except jax.errors.JaxRuntimeError as e:  # A collective's: is a process of the run gone?
      launch.exit_if_a_process_was_lost(e, F.workdir,
                                        wait=min(5.0, F.heartbeat_timeout / 2))
      raise
  if jax.process_count() == 1:  # (Several processes: jax.distributed's exit syncs them.)
    # Every file written and closed, the ledger's last line included: the run ends here, as
    # translate does, rather than a second later, after jax's runtime is torn down.
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
