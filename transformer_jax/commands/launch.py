"""Process start-up shared by the commands: flag parsing with one-line errors, and joining a
multi-process run."""

from __future__ import annotations

import ctypes
import re
import sys
import threading
import time
from pathlib import Path

import jax
from absl import flags, logging

from transformer_jax import config as config_lib, errors


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
                           distributed: str, init_timeout: int = 300,
                           heartbeat_timeout: int = 100) -> None:
  """jax.distributed from the flags (num_processes > 1), else, with distributed="auto", from a
  detected cluster's environment; nothing for a single process. `init_timeout`: seconds for
  every process to join; `heartbeat_timeout`: seconds of silence after which the coordinator
  counts a process as dead (jax's defaults)."""
  timeouts = dict(initialization_timeout=init_timeout,
                  heartbeat_timeout_seconds=heartbeat_timeout)
  if num_processes > 1:
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
  elif distributed == "auto" and (cluster := detected_cluster()):
    logging.info("Cluster environment %r detected: jax.distributed from its variables", cluster)
    jax.distributed.initialize(**timeouts)
    logging.info("Process %d of %d, %d devices in all", jax.process_index(),
                 jax.process_count(), jax.device_count())


def command_help(module_name: str) -> str:
  """A command's --help: its module's docstring and the flags it defines, with their defaults."""
  module = sys.modules[module_name]
  lines = [(module.__doc__ or "").strip(), "", "flags:"]
  for flag in sorted(flags.FLAGS.get_flags_for_module(module_name), key=lambda f: f.name):
    default = f" (default: {flag.default_as_str})" if flag.default is not None else ""
    lines.append(f"  --{flag.name}: {' '.join((flag.help or '').split())}{default}")
  return "\n".join(lines)


def flags_parser(module_name: str):
  """`parse_flags` for the command defined in `module_name`, whose --help (-h, --helpshort)
  prints the command's docstring and flags and exits 0 (absl's lists none of them: they are
  not defined in the main module)."""
  def parse(argv: list[str]) -> list[str]:
    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
      print(command_help(module_name))
      sys.exit(0)
    return parse_flags(argv)
  return parse


def _cause(e: BaseException) -> BaseException | None:
  """What `e` was raised from or while handling, unless it was raised `from None`."""
  return e.__cause__ if e.__cause__ is not None else (
      None if e.__suppress_context__ else e.__context__)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag, flag value, config file or config override reported
  in one line."""
  for i, arg in enumerate(argv):  # absl only says it failed loading "config_config".
    value = (arg.split("=", 1)[1] if arg.startswith("--config=") else
             argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
    if value is not None and not Path(value.partition(":")[0]).is_file():
      sys.exit(f"error: --config {value}: {value.partition(':')[0]} is not a file")
  overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
  if overrides and not any(a == "--config" or a.startswith("--config=") for a in argv):
    sys.exit(f"error: {overrides[0]}: a config override needs --config (a run resumed with "
             "--workdir alone takes its config.json whole): give the recipe's config file "
             "with the override, e.g. --config configs/fra_eng.py")
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # config_flags raises KeyError, AttributeError, TypeError, ...
    missing = e if isinstance(e, KeyError) else e.__context__
    if isinstance(missing, KeyError):  # An override of a field the config does not have.
      # ml_collections' message: the name, and on a line of its own a suggestion.
      text = str(missing.args[0]) if missing.args else ""
      name = text.splitlines()[0].strip("'\"") if text else ""
      guess = re.search(r'Did you mean "(\w+)"', text)
      given = [a.split("=")[0] for a in argv
               if a.startswith("--config.") and a.split("=")[0].split(".")[-1] == name]
      flag = given[0] if given else name
      now = config_lib.moved(flag.removeprefix("--config.")) if flag.count(".") == 1 else None
      if now:  # A field of the flat config the sections replaced.
        sys.exit(f"error: {flag}: no such config field; it is --config.{now} (the fields and "
                 "their meanings are in transformer_jax/config.py)")
      if guess:
        sys.exit(f"error: {flag}: no such config field; did you mean "
                 f"{flag.rsplit('.', 1)[0]}.{guess.group(1)}? (the fields and their meanings "
                 "are in transformer_jax/config.py)")
      sys.exit(f"error: {flag}: no such config field (the fields and "
               "their meanings are in transformer_jax/config.py)")
    root = e  # A config file that fails to load: the cause, not absl's wrapper.
    while _cause(root) is not None:
      root = _cause(root)
    if root is not e and str(e).startswith("flag --config"):
      flag = str(e).split(": ", 1)[0].removeprefix("flag ")  # --config=configs/x.py:ARG
      sys.exit(f"error: {flag}: {errors.first_line(root)}")
    sys.exit(f"error: {errors.first_line(e)}")


def use_compilation_cache(workdir: str | Path, directory: str | None = None) -> Path | None:
  """Turns on jax's persistent compilation cache for a command that decodes with `workdir`'s
  model: `directory`, else the training run's (run.compilation_cache_dir, or WORKDIR/jax_cache),
  so that a later command (or a restart) loads its programs instead of compiling them. Every
  program is kept, however fast it compiled: a command compiles a handful. Returns the cache's
  directory; None, with one warning, where it cannot be written (a read-only workdir): the
  command then compiles without it (jax would warn at every program)."""
  from transformer_jax import fs
  from transformer_jax.runs.workdir import Workdir
  run_dir = Workdir(workdir)
  path = Path(directory or run_dir.load_config().run.compilation_cache_dir or run_dir.jax_cache)
  try:
    fs.check_writable(path, "the compilation cache")
  except fs.NotWritableError as e:
    logging.warning("%s: compiling without it (--compilation_cache_dir names another)", e)
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


# glibc's mallopt parameters (malloc.h) and the values keep_freed_memory sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_KEPT = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2 << 30), (_M_TOP_PAD, 256 << 20))


def keep_freed_memory() -> bool:
  """Has glibc's malloc keep the memory a process frees for its next allocations instead of
  giving it back to the system: every block from the heap, however large (no block mapped of
  its own), the heap trimmed only past 2 GB free, and grown 256 MB at a time. Decoding
  allocates and frees arrays of a few to tens of MB at every call of its programs (an encoder
  batch's keys and values, a run's temporaries), and each one given back was paged in again:
  a translate command of the Tatoeba file took 0.7-0.9 million page faults, 0.45-0.51 million with
  blocks of up to 32 MB kept (glibc's largest mapping threshold), 0.37-0.39 million with every
  block kept; a server's run of 16 of 32 beam-4 slots of 64-token sources took 10,442 faults
  a call with the 32 MB threshold (docs/translating.md, docs/serving.md). Returns whether the
  settings took (False: not glibc)."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):  # Another C library (musl): its defaults stay.
    return False
  return all(mallopt(parameter, value) == 1 for parameter, value in _KEPT)


def lost_processes(wait: float) -> list[int] | None:
  """After a collective failed: the processes of this multi-process run that did not answer a
  roll call within `wait` seconds ([] where all did), None where jax's coordination service
  cannot be reached (process 0, which hosts it, is gone).

  Each process whose collective failed writes its number under one key directory of the
  service's key-value store and reads who else has. The service's own view of the dead (its
  heartbeats) comes only after --heartbeat_timeout, and then it ends every process with an
  abort, so the roll call must end first. Reads `jax._src.distributed.global_state.client`
  (not a public API: where it moves, the answer is None)."""
  try:
    from jax._src.distributed import global_state
    client, me = global_state.client, jax.process_index()
    everyone = set(range(jax.process_count()))
  except (ImportError, AttributeError):
    return None
  answer: list = []

  def call():
    try:
      client.key_value_set(f"{ROLL_CALL}{me}", "here", allow_overwrite=True)
      deadline = time.monotonic() + wait
      while True:
        here = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(ROLL_CALL)}
        if here >= everyone or time.monotonic() > deadline:
          answer.append(sorted(everyone - here))
          return
        time.sleep(0.2)
    except Exception:  # An RPC error: the coordinator is unreachable.
      answer.append(None)

  calling = threading.Thread(target=call, daemon=True)
  calling.start()
  calling.join(wait + 5)
  return answer[0] if answer else None


ROLL_CALL = "transformer_jax/collective_failed/"


def exit_if_a_process_was_lost(error: BaseException, workdir: str, wait: float) -> None:
  """After a collective of a multi-process run failed (`error`): where another process of the
  run is gone, one line that names it and the step the same command resumes from, and exit 1
  at once, not after jax's shutdown barrier (which waits for the lost process, then aborts).
  Returns where every process is alive (the error is another one)."""
  if jax.process_count() < 2:
    return
  lost = lost_processes(wait)
  if lost == []:
    return
  from transformer_jax.runs.workdir import Workdir
  steps = Workdir(workdir).checkpoint_steps()
  resume = f"from the checkpoint of step {max(steps)}" if steps else "from the start"
  who = ("process 0, which coordinates the run," if lost is None else
         " and ".join(f"process {p}" for p in lost))
  errors.exit_at_once(
      f"{who} of {jax.process_count()} stopped ({errors.first_line(error)[:200]}); run the "
      f"same command on every host to resume {resume}", 1)
