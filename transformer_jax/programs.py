"""Compiled programs kept on disk, so that a later command runs them at once.

jax's persistent compilation cache saves the compiling, but a command still traces and lowers
every program to find its cache entry: for the decoding slots of three width classes, several
seconds of a command's start (kept for that: a warm `translate` of 100 sentences takes 9.9 s
with this store and 25.0 s with jax's cache alone on 2 cores, docs/results.md). A `ProgramStore`
keeps the compiled executable itself (jax.experimental.serialize_executable), under a key made
of what the program is (its name, the caller's description of what it closes over, its
arguments' shapes and types) and of what built it (jax and jaxlib, the device, this CPU's model
and instruction sets, XLA_FLAGS and this package's source code): a later process with the same
key loads it and neither traces, lowers nor compiles. A program the store cannot write or read
back (a file cut short, another jax) is compiled again, with a warning. The files are pickles:
keep the directory as private as the workdir it belongs to.

A command may also name its settings (`preload`): the store then loads, in a thread of its
own, the programs that the last command of the same settings used (`remember` keeps their
list), while the command goes on restoring its checkpoint, instead of loading each where it is
first called. Loading one is C++ work outside Python's lock (on 2 cores, 40-120 ms for one of
the decoding slots' run programs), so it overlaps the restoring. A listed program the command
does not call costs only its loading; one it calls that is not listed loads when called.

A store holds at most `max_bytes` (MAX_BYTES, 2 GiB, by default): each build of the package
keys a new set of programs, so the sets of earlier builds would pile up. Loading a program
marks it used (its file's modification time), and a store that writes a file then removes
the least recently used of its own files (programs, kept values, lists of programs used)
until the directory holds at most three quarters of `max_bytes`: never a file this process
used or wrote, nor any other file of the directory.

A store compiles its programs around jax's persistent compilation cache, neither reading nor
writing it: on a CPU (jax 0.10.2) an executable that the cache gave back serializes without
some of its kernels, and the copy loaded from that fails to run ("Function ... not found").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import pickle
import platform
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import flax
import jax
import numpy as np
from absl import logging
from jax.experimental import serialize_executable

from transformer_jax import fs


# The most bytes a store's directory holds before its least recently used files go.
MAX_BYTES = 2 << 30

# What a store writes in its directory (and so may remove): programs, kept values, the lists
# of programs used.
_OWN_FILES = ("*.executable", "*.pickle", "used-*.json")


@functools.cache
def _build_key() -> str:
  """What built a program: jax, jaxlib, flax (the modules a program and the kept abstract
  parameters come from), the devices, the host CPU (an executable is compiled for its
  instruction sets), XLA_FLAGS and this package's code."""
  digest = hashlib.sha256()
  device = jax.devices()[0]
  for part in (jax.__version__, jax.lib.__version__, flax.__version__, device.platform,
               device.device_kind,
               str(jax.device_count()), platform.machine(), _cpu_flags(),
               os.environ.get("XLA_FLAGS", "")):
    digest.update(part.encode() + b"\0")
  for path in sorted(Path(__file__).parent.rglob("*.py")):
    digest.update(path.read_bytes())
  return digest.hexdigest()


def _key(*parts: str) -> str:
  """A file name's key for what this build made of `parts` (a program's name, description...)."""
  return hashlib.sha256("\0".join((_build_key(), *parts)).encode()).hexdigest()[:40]


def _cpu_flags() -> str:
  """The host CPU's model and instruction-set flags (Linux), else its name."""
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor()
  return "\n".join(sorted({line for line in lines
                           if line.startswith(("model name", "flags", "Features"))}))


def _signature(args) -> tuple:
  """What tells programs of one function apart: the arguments' tree, shapes and types. This
  runs at every call, over every parameter: an array's own shape and dtype are read (about
  0.5 us a leaf), not jax.typeof's or np.result_type's (on a jax array, about 5 us: a
  deprecation check each time); a Python number is what jax makes of it, a weakly typed
  scalar."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) if hasattr(x, "dtype")
                     else ((), jax.dtypes.canonicalize_dtype(np.result_type(x)),
                           not isinstance(x, bool))
                     for x in leaves)


class ProgramStore:
  """Programs compiled once per key into `directory` (None: nothing kept; `jit` is then jax.jit
  behind the same compile-once lock). Functions of one store whose programs have the same key
  share the program loaded."""

  def __init__(self, directory: str | Path | None, max_bytes: int = MAX_BYTES):
    self.directory = Path(directory) if directory else None
    self.max_bytes = max_bytes
    self._mine: set[str] = set()  # Files this store used or wrote: never removed by it.
    # What the store's files held at the last look (None: not looked yet), plus what this
    # store wrote since: the directory is listed again only when that passes max_bytes.
    self._held: int | None = None
    # Programs by file, for every function of this store: a Future of the program that
    # `preload`'s thread or the first call loading (or compiling) it gives (None in it where
    # that failed).
    self._taken: dict[Path, concurrent.futures.Future] = {}
    self._taken_lock = threading.Lock()
    self._used: dict[str, None] = {}  # The files of the programs called, first called first.
    self.preloaded = 0  # Programs preload's thread loaded (what a call then found ready).
    self.loaded = 0  # Programs loaded from the directory, by that thread or by a call.
    # Programs compiled here (none was kept, the kept one did not load, or no directory).
    self.compiled = 0

  def _list_path(self, settings: str) -> Path:
    """Where `remember` keeps the programs of a command of `settings` (and of this build)."""
    return self.directory / f"used-{_key(settings)}.json"

  def preload(self, settings: str) -> threading.Thread | None:
    """Starts loading, in a daemon thread (returned), the kept programs the last command of
    `settings` (a description of whatever decides which programs a command runs) used, in the
    order it first called them. None where there is no directory or no such list."""
    if self.directory is None:
      return None
    try:
      names = json.loads(self._list_path(settings).read_text())
    except (OSError, ValueError):
      return None
    if not isinstance(names, list):  # Not a list this store wrote: nothing to load.
      return None
    paths = [self.directory / name for name in names
             if isinstance(name, str) and Path(name).name == name]  # Files of this directory.
    thread = threading.Thread(target=self._load_all, args=(paths,), daemon=True,
                              name="preload programs")
    thread.start()
    return thread

  def _load_all(self, paths: list[Path]) -> None:
    for path in paths:
      with self._taken_lock:
        if path in self._taken:  # A call took it first.
          continue
        self._taken[path] = future = concurrent.futures.Future()
      program = None
      try:
        program = self._loaded(path)
      except Exception:  # noqa: BLE001 -- the call that needs it loads (or compiles) it again.
        pass
      finally:
        future.set_result(program)
      if program is not None:
        self.preloaded += 1

  def remember(self, settings: str) -> None:
    """Keeps the list of the programs called so far, for the next `preload(settings)`."""
    if self.directory is None or not self._used:
      return
    path = self._list_path(settings)
    with self._taken_lock:
      text = json.dumps(list(self._used))
    try:
      if not path.exists() or path.read_text() != text:
        fs.replace_file(path, text.encode())
        self._wrote(path)
      else:
        self._mark_used(path)
    except OSError as e:  # Keeping it is an optimization, never a failure.
      logging.warning("could not keep the list of programs used in %s (%s)", path, e)

  def value(self, name: str, describe: str, compute: Callable[[], Any]) -> Any:
    """What `compute()` returns, kept (pickled) under `name` and `describe` for this build, like
    a program: for what costs a command's start more to compute than to read back, such as a
    model's abstract parameters (tracing its init). No directory: computed each time."""
    if self.directory is None:
      return compute()
    path = self.directory / f"{name}-{_key(name, describe)}.pickle"
    if path.exists():
      try:
        value = pickle.loads(path.read_bytes())
        self._mark_used(path)
        return value
      except Exception as e:  # noqa: BLE001 -- a damaged entry is computed again.
        logging.warning("computing %s again: %s did not load (%s)", name, path, e)
    value = compute()
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      fs.replace_file(path, pickle.dumps(value))
      self._wrote(path)
    except (OSError, TypeError, pickle.PicklingError) as e:  # An optimization, never a failure.
      logging.warning("could not keep %s in %s (%s)", name, self.directory, e)
    return value

  def jit(self, name: str, describe: str, fn: Callable, **jit_args) -> Callable:
    """jax.jit(fn, **jit_args), its programs kept under `name` and `describe`: a description of
    everything the function closes over (sizes, settings, constants) that its arguments' shapes
    do not say. Threads may call it at once: each program is compiled by one of them.

    The function returned has `compile(*args)`: makes the program for arguments like `args`
    (arrays, or jax.ShapeDtypeStructs of them) ready, compiled or loaded, without running it."""
    ready: dict[tuple, Callable] = {}  # By signature: the programs compiled (or loaded).
    lock = threading.Lock()

    def program_for(args, signature):
      with lock:  # Threads that meet a program first at once: one compiles it, the rest wait.
        program = ready.get(signature)
        if program is None:
          program = ready[signature] = self._program(name, describe, signature, fn, jit_args,
                                                     args)
      return program

    def call(*args):
      signature = _signature(args)
      program = ready.get(signature)
      if program is None:
        program = program_for(args, signature)
      return program(*args)

    def compile_only(*args) -> None:
      program_for(args, _signature(args))

    call.compile = compile_only
    return call

  def _program(self, name: str, describe: str, signature: tuple, fn: Callable,
               jit_args: dict, args):
    """The compiled program of `fn` for `args`: loaded from the directory (or taken from
    another function of this store with the same key), else compiled and kept there."""
    if self.directory is None:
      compiled = jax.jit(fn, **jit_args).lower(*args).compile()
      with self._taken_lock:
        self.compiled += 1
      return compiled
    path = self.directory / f"{name}-{_key(name, describe, repr(signature))}.executable"
    with self._taken_lock:
      self._used.setdefault(path.name)
      taken = self._taken.get(path)
      if taken is None:  # Loaded (or compiled) here; a call of the same key meanwhile waits.
        self._taken[path] = future = concurrent.futures.Future()
    if taken is not None:
      program = taken.result()
      if program is not None:
        return program
      # Preloading it failed: loaded or compiled again below, not shared.
    program = None
    try:
      program = self._load_or_compile(name, path, fn, jit_args, args)
      return program
    finally:
      if taken is None:
        future.set_result(program)  # None where it raised: a waiting call tries for itself.

  def _load_or_compile(self, name: str, path: Path, fn: Callable, jit_args: dict, args):
    if path.exists():
      try:
        return self._loaded(path)
      except Exception as e:  # noqa: BLE001 -- a stale or damaged entry is compiled again.
        logging.warning("compiling %s again: its kept program %s did not load (%s)", name, path,
                        e)
    compiled = _compile_apart(name, fn, jit_args, args)
    with self._taken_lock:
      self.compiled += 1
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      fs.replace_file(path, pickle.dumps(serialize_executable.serialize(compiled)))
      self._wrote(path)
    except (OSError, ValueError, TypeError, pickle.PicklingError) as e:
      # Keeping it is an optimization, never a failure.
      logging.warning("could not keep the compiled %s in %s (%s)", name, self.directory, e)
    return compiled

  # --- the directory's size ----------------------------------------------------------------

  def _loaded(self, path: Path):
    """The program kept in `path`, marked used (raises where it does not load)."""
    program = _load(path)
    self._mark_used(path)
    with self._taken_lock:
      self.loaded += 1
    return program

  def _mark_used(self, path: Path) -> None:
    """`path` is this process's (never removed by this store) and used now: its modification
    time, which the least recently used go by."""
    with self._taken_lock:
      self._mine.add(path.name)
    try:
      os.utime(path)
    except OSError:  # Not ours to change (a directory shared read-only): it stays as it is.
      pass

  def _wrote(self, path: Path) -> None:
    """After writing `path`: removes the least recently used files where the store holds too
    much (`prune`; on a directory of 2,300 files its listing took 60-80 ms, so it is listed
    once, then again only when what was written since may have passed max_bytes)."""
    with self._taken_lock:
      self._mine.add(path.name)
      if self._held is not None:
        try:
          self._held += path.stat().st_size
        except OSError:
          pass
        if self._held <= self.max_bytes:
          return
    self.prune()

  def prune(self) -> list[Path]:
    """Where the directory's files of this store's kinds (_OWN_FILES) hold more than
    `max_bytes`, removes those used least recently, except this process's, until they hold at
    most three quarters of it. Returns the files removed."""
    if self.directory is None:
      return []
    files = []
    for pattern in _OWN_FILES:
      for path in self.directory.glob(pattern):
        try:
          info = path.stat()
        except OSError:  # Removed meanwhile (another process pruning).
          continue
        files.append((info.st_mtime, path, info.st_size))
    held = sum(size for _, _, size in files)
    self._held = held
    if held <= self.max_bytes:
      return []
    with self._taken_lock:
      mine = set(self._mine)
    removed = []
    for _, path, size in sorted(files, key=lambda file: file[0]):  # Least recently used first.
      if held <= self.max_bytes * 3 // 4:
        break
      if path.name in mine:
        continue
      try:
        path.unlink()
      except FileNotFoundError:  # Another process removed it first.
        pass
      except OSError as e:  # The store goes on without it; the next write tries again.
        logging.warning("could not remove %s from the kept programs (%s)", path, e)
        continue
      removed.append(path)
      held -= size
    self._held = held
    if removed:
      logging.info("removed %d kept files used least recently from %s, which now holds %.0f MB "
                   "(at most %.0f MB)", len(removed), self.directory, held / 2**20,
                   self.max_bytes / 2**20)
    return removed


def _load(path: Path):
  """The compiled program kept in `path` (raises where it does not load)."""
  return serialize_executable.deserialize_and_load(*pickle.loads(path.read_bytes()))


def _compile_apart(name: str, fn: Callable, jit_args: dict, args):
  """jax.jit(fn, **jit_args) compiled for `args` around the persistent compilation cache: under
  a module name of its own (no entry of the cache has it, so none is read) and, where jax offers
  the thread's setting, with the cache's minimum compile time out of reach (none is written)."""
  def program(*inner):
    return fn(*inner)
  program.__name__ = program.__qualname__ = f"kept_{name}_{uuid.uuid4().hex[:12]}"
  with _no_cache_writes():
    return jax.jit(program, **jit_args).lower(*args).compile()


def _no_cache_writes():
  """A context in which this thread's compilations write no persistent cache entry (jax's
  private per-thread setting; where a jax lacks it, nothing: the entries written are never
  read, their module names being unique)."""
  try:
    from jax._src import config as jax_config  # noqa: PLC0415 -- private, so guarded.
    return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
  except (ImportError, AttributeError, TypeError):
    return contextlib.nullcontext()
