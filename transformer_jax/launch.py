"""Process start-up shared by the commands: flag parsing with one-line errors, and joining a
multi-process run."""

from __future__ import annotations

import sys

import jax
from absl import flags, logging


def detected_cluster() -> str | None:
  """The name of the cluster environment jax's own auto-detection would use, or None.

  Reads jax's registry of cluster types (`jax._src.clusters`, not a public API: where it
  moves, detection is off and the flags still work).
  """
  try:
    from jax._src.clusters import ClusterEnv
    return next((env.name for env in ClusterEnv._cluster_types
                 if not env.opt_in_only_method and env.is_env_present()), None)
  except (ImportError, AttributeError):
    return None


def initialize_distributed(coordinator_address: str | None, num_processes: int, process_id: int,
                           distributed: str) -> None:
  """jax.distributed from the flags (num_processes > 1), else, with distributed="auto", from a
  detected cluster's environment; nothing for a single process."""
  if num_processes > 1:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif distributed == "auto" and (cluster := detected_cluster()):
    logging.info("Cluster environment %r detected: jax.distributed from its variables", cluster)
    jax.distributed.initialize()
    logging.info("Process %d of %d, %d devices in all", jax.process_index(),
                 jax.process_count(), jax.device_count())


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or config override reported in one line."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # config_flags raises KeyError, AttributeError, TypeError, ...
    missing = e if isinstance(e, KeyError) else e.__context__
    if isinstance(missing, KeyError):  # An override of a field the config does not have.
      name = str(missing.args[0]).strip("'\"") if missing.args else ""
      given = [a.split("=")[0] for a in argv
               if a.startswith("--config.") and a.split("=")[0].split(".")[-1] == name]
      sys.exit(f"error: {given[0] if given else name}: no such config field (the fields and "
               "their meanings are in transformer_jax/config.py)")
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    sys.exit(f"error: {message}")
