"""A run's directory: the one place its layout is spelled, and its files read and written
(config, tokenizer, labels, checkpoints, the writer's lock).

  WORKDIR/
    config.json          the config the run trains with (written by train.py)
    tokenizer.model      the SentencePiece model (or vocab.json: d2l's word vocabularies)
    labels.json          a classifier's label names, in the order of its outputs
    checkpoints/STEP/    orbax checkpoints: train state, data position, fingerprints
    metrics.jsonl        training and evaluation scalars; TensorBoard events beside it
    goodput.jsonl        where each life of the run spent its wall time (training/goodput.py)
    jax_cache/           JAX's compilation cache (unless compilation_cache_dir says otherwise)
    writer.lock          while a run writes the workdir: held by it (its process and host inside)

train.py resumes from one (training/resume.py checks it first); the commands that use a
trained run (translate, generate, fill, classify, average, visualize, export, serve, aot's
saved programs) restore it through runs/restore.py; report reads its two logs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path

from absl import logging

from transformer_jax import checkpoint, config as config_lib, errors
from transformer_jax.data.tokenizer import HF_FILE, SPM_FILE, WORD_FILE, Tokenizers
from transformer_jax.errors import UserError

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
JAX_CACHE = "jax_cache"
LOCK = "writer.lock"
LABELS = "labels.json"
# What a run may have written before its config.json (besides TensorBoard's event files).
_WRITTEN_BEFORE_CONFIG = {CHECKPOINTS, JAX_CACHE, LOCK, LABELS, "tokenizer.model", "vocab.json",
                          "metrics.jsonl"}
# What each kind of run holds, and the command that uses it.
MODEL_KINDS = {"encoder_decoder": ("translation model", "translate"),
               "decoder_only": ("language model", "generate"),
               "encoder_only": ("masked language model", "fill"),
               "classifier": ("classifier", "classify")}


# What a process read of runs' files (a command opens its run in several places: the flags'
# checks, the runner, the server), by the files' identity: a file replaced or rewritten is read
# again. A config is frozen dataclasses and a tokenizer is not changed once loaded.
_READ: dict[tuple, object] = {}
_READ_AT_MOST = 64
TOKENIZER_FILES = (HF_FILE, SPM_FILE, WORD_FILE)  # What Tokenizers.load reads.


def _stamp(path: Path) -> tuple | None:
  """A file's identity as read (path, inode, size, modification time), None where it is not."""
  try:
    s = path.stat()
  except OSError:
    return None
  return str(path.absolute()), s.st_ino, s.st_size, s.st_mtime_ns


def _remember(stamp: tuple, value):
  if len(_READ) >= _READ_AT_MOST:
    _READ.clear()
  if value is not None:
    _READ[stamp] = value
  return value


class WorkdirError(UserError, ValueError):
  """A directory that is not a (usable) training workdir."""


def check_outside_runs(path: str | Path, flag: str = "") -> None:
  """A one-line WorkdirError where the new directory `path` (the value of `flag`) would be
  inside a training workdir: an ancestor holding a run's checkpoints/ or writer.lock. The run's
  files are the run's, and train.py takes a checkpoint-shaped folder under checkpoints/ for a
  damaged checkpoint."""
  if (run := _run_holding(Path(path).resolve())) is not None:
    raise WorkdirError(f"{flag + ' ' if flag else ''}{path} is inside the workdir {run}: "
                       "name a directory outside it (its files are the run's)")


def _run_holding(path: Path) -> Path | None:
  """The training workdir `path` (resolved) lies in, if any."""
  return next((parent for parent in path.parents
               if (parent / CHECKPOINTS).is_dir() or (parent / LOCK).exists()), None)


def check_file_outside_runs(path: str | Path, flag: str, may_add: str = "") -> None:
  """A one-line WorkdirError where the output file `path` (the value of `flag`) lies inside a
  training workdir. `may_add` ("png") lets a new file of that suffix, or one already of that
  kind, sit directly in a workdir beside its files (report's curves), never in place of one of
  them nor under checkpoints/."""
  resolved = Path(os.path.realpath(path))
  for parent in resolved.parents:  # A dataset's or a token cache's files are read by runs.
    for marker, what in (("dataset_info.json", "the prepared dataset"),
                         ("meta.json", "the token cache")):
      if (parent / marker).is_file() and (what != "the token cache"
                                           or any(parent.glob("*.tokens"))):
        raise WorkdirError(f"{flag} {path} is inside {what} {parent}: name a file outside it")
  run = _run_holding(resolved)
  if run is None:
    return
  ours = resolved.name in {CONFIG, LOCK, LABELS, "metrics.jsonl", "goodput.jsonl",
                           *TOKENIZER_FILES}
  if (may_add and resolved.parent == run and not ours
      and resolved.suffix.lower() == f".{may_add}"):
    return
  raise WorkdirError(f"{flag} {path} is inside the workdir {run}: name a file outside it "
                     "(its files are the run's)")


class Workdir:
  """A training run's directory (it need not exist yet)."""

  def __init__(self, path: str | Path):
    if not str(path).strip():
      raise WorkdirError("--workdir is empty; name a directory for the run")
    self.path = Path(path)

  def __str__(self) -> str:
    return str(self.path)

  @property
  def config_file(self) -> Path:
    return self.path / CONFIG

  @property
  def checkpoints(self) -> Path:
    return self.path / CHECKPOINTS

  @property
  def jax_cache(self) -> Path:
    return self.path / JAX_CACHE

  @contextlib.contextmanager
  def writer_lock(self):
    """Holds the workdir's writer lock while the block runs: one run writes a workdir at a time.

    The lock is the operating system's (flock on `writer.lock`, which names the process that
    holds it), so a run that dies, however it dies, holds it no longer; the file is removed
    when the block ends, and one left behind (a killed run's) is taken over with a warning.

    Raises:
      WorkdirError: another process holds it (the message names that process).
    """
    made = not self.path.exists()
    self.path.mkdir(parents=True, exist_ok=True)
    path = self.path / LOCK
    while True:
      lock = open(path, "a+", encoding="utf-8")
      try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        lock.close()
        self._raise_busy()
      try:  # Its holder may have removed the file as this one opened it: lock the new one.
        if os.path.samestat(os.fstat(lock.fileno()), os.stat(path)):
          break
      except FileNotFoundError:
        pass
      lock.close()
    lock.seek(0)
    if previous := lock.read().strip():  # A run that ended without removing it: killed.
      logging.warning("%s was left locked by %s, which has ended: taking it over", self.path,
                      previous)
    lock.seek(0)
    lock.truncate()
    lock.write(f"process {os.getpid()} on {socket.gethostname()}")
    lock.flush()
    try:
      yield
    finally:
      # Before the unlock: whoever locks next locks a file of its own. (missing_ok: a user may
      # have removed the workdir; the block's own error, if any, is the one to report.)
      path.unlink(missing_ok=True)
      if made and self.path.is_dir() and not any(self.path.iterdir()):
        self.path.rmdir()  # A run that wrote nothing (it failed first) leaves nothing.
      fcntl.flock(lock, fcntl.LOCK_UN)
      lock.close()

  def check_free(self) -> None:
    """Raises WorkdirError where a run holds the writer lock (the first check a run makes:
    another's checkpoints and config may still change under it). Creates nothing."""
    if self.writer() is not None:
      self._raise_busy()

  def writer(self) -> str | None:
    """Who holds the writer lock now ("process PID on HOST"), or None where no run does."""
    try:
      lock = open(self.path / LOCK, encoding="utf-8")
    except OSError:
      return None
    with lock:
      try:
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
      except BlockingIOError:
        return lock.read().strip() or "another process"
      fcntl.flock(lock, fcntl.LOCK_UN)
    return None

  def _raise_busy(self):
    holder = self.writer() or "another process"
    raise WorkdirError(f"--workdir {self.path} is being written by {holder}: wait for that run "
                       "to end, or name another workdir") from None

  def checkpoint_steps(self) -> list[int]:
    """Steps of the checkpoint directories present (verified or not), ascending."""
    return sorted(int(p.name) for p in self.checkpoints.glob("[0-9]*") if p.name.isdigit())

  # The config.

  def load_config(self) -> config_lib.Config:
    """The config the run was trained with: its sections, each field this version added since
    taken from the defaults (a config.json from before sections is read too).

    Raises:
      WorkdirError: the workdir holds no config.json, or a damaged one.
    """
    if not self.config_file.is_file():
      raise WorkdirError(f"{self.path} holds no {CONFIG}: not a training workdir")
    stamp = _stamp(self.config_file)
    if stamp in _READ:  # Read once a process, as long as the file is the same.
      return _READ[stamp]
    try:
      saved = json.loads(self.config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise WorkdirError(f"{self.config_file} is damaged ({e}); restore it from a copy") from None
    if not isinstance(saved, dict):
      raise WorkdirError(f"{self.config_file} is damaged (not a JSON object); restore it from a "
                         "copy")
    if why := config_lib.why_not_a_runs_config(saved):
      raise WorkdirError(f"{self.config_file} is not a training run's config ({why}): "
                         f"{self.path} is not a training workdir")
    try:
      return _remember(stamp, config_lib.parse(saved, saved=True))
    except (config_lib.ConfigError, TypeError) as e:
      raise WorkdirError(f"{self.config_file} is damaged ({errors.first_line(e)}); restore it "
                         "from a copy") from None

  def write_config(self, cfg: config_lib.Config) -> None:
    """Replaces config.json whole: another host may be reading the previous one."""
    self.path.mkdir(parents=True, exist_ok=True)
    partial = self.path / (CONFIG + ".tmp")
    partial.write_text(json.dumps(cfg.to_dict(), indent=2))
    partial.replace(self.config_file)

  def check_is_a_run(self) -> None:
    """Raises WorkdirError unless the directory is missing, empty, or a run's: train.py writes
    into nothing else. A run's holds this project's config.json or, where it stopped before
    writing one, only what a run writes first (and hidden files)."""
    if not self.path.is_dir() or not any(self.path.iterdir()):
      return
    if self.config_file.exists():
      self.load_config()  # Raises where it is another program's config.json, or damaged.
      return
    foreign = sorted(p.name for p in self.path.iterdir()  # Hidden files (.DS_Store) aside.
                     if p.name not in _WRITTEN_BEFORE_CONFIG
                     and not p.name.startswith(("events.out.tfevents.", ".")))
    if foreign:
      shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
      raise WorkdirError(f"--workdir {self.path} is not a training workdir (it holds {shown} "
                         f"and no {CONFIG}): name a new or empty directory, or a run's")

  # Opening a trained run.

  def _saved_tokenizers(self) -> Tokenizers | None:
    """The tokenizers saved in the workdir (None: none), read once while their file is the
    same."""
    stamp = ("tokenizers",) + tuple(_stamp(self.path / name) for name in TOKENIZER_FILES)
    return _READ.get(stamp) or _remember(stamp, Tokenizers.load(self.path))

  def tokenizers(self) -> Tokenizers:
    tokenizers = self._saved_tokenizers()
    if tokenizers is None:
      raise WorkdirError(f"{self.path} holds no tokenizer (tokenizer.model, vocab.json or "
                         "tokenizer.huggingface.json)")
    return tokenizers

  def model_kind(self) -> str:
    """What the run trained: its model.family, or "classifier" for an encoder-only model
    trained on labelled texts (it keeps their labels: MODEL_KINDS)."""
    family = self.load_config().model.family
    return "classifier" if family == "encoder_only" and self.labels() else family

  def check_family(self, kind: str | tuple[str, ...], command: str) -> None:
    """A one-line WorkdirError where the run's model is not of `kind` (a model.family or
    "classifier": MODEL_KINDS; or one of several), which `command` needs."""
    kinds = (kind,) if isinstance(kind, str) else kind
    saved = self.model_kind()
    if saved not in kinds:
      needs = " or a ".join(MODEL_KINDS[k][0] for k in kinds)
      raise WorkdirError(f"{self.path} holds a {MODEL_KINDS[saved][0]} (model.family="
                         f"{self.load_config().model.family!r}): `{command}` needs a "
                         f"{needs}; use `{MODEL_KINDS[saved][1]}`")

  def labels(self) -> tuple[str, ...]:
    """A classifier's label names, in the order of its outputs; () for the other models."""
    path = self.path / LABELS
    if not path.is_file():
      return ()
    try:
      names = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise WorkdirError(f"{path} is damaged ({e}); restore it from a copy") from None
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
      raise WorkdirError(f"{path} is damaged (not a list of label names); restore it from a "
                         "copy")
    return tuple(names)

  def write_labels(self, names: tuple[str, ...]) -> None:
    self.path.mkdir(parents=True, exist_ok=True)
    partial = self.path / (LABELS + ".tmp")
    partial.write_text(json.dumps(list(names), ensure_ascii=False, indent=1), encoding="utf-8")
    partial.replace(self.path / LABELS)

  def checkpointer(self, save_every: int = 1, keep: int = 1,
                   read_only: bool = False) -> checkpoint.Checkpointer:
    if read_only and not self.checkpoints.is_dir():
      raise WorkdirError(f"{self.path} holds no {CHECKPOINTS}/ directory")
    tokenizers = self._saved_tokenizers()
    return checkpoint.Checkpointer(self.checkpoints, save_every, keep, read_only=read_only,
                                   tokenizer_digest=tokenizers and tokenizers.digest())

  def copy_run_files(self, to: Path, tokenizers: Tokenizers) -> None:
    """config.json, the tokenizer and a classifier's labels into the directory `to` (a derived
    workdir)."""
    to.mkdir(parents=True, exist_ok=True)
    (to / CONFIG).write_bytes(self.config_file.read_bytes())
    tokenizers.save(to)
    if self.labels():
      Workdir(to).write_labels(self.labels())


