"""Traced programs kept on disk, so that a later command neither traces nor lowers them.

jax's persistent compilation cache saves the compiling, but a command still traces and lowers
every program to find its cache entry: for the decoding slots of three width classes, several
seconds of a command's start. A `ProgramStore` keeps each program as jax.export serializes it
(StableHLO and its calling convention), under a key made of what the program is (its name, the
caller's description of what it closes over, its arguments' shapes and types) and of what built
it (jax and jaxlib, the device, XLA_FLAGS and this package's source code): a later process with
the same key loads it instead of tracing, and the compilation cache gives its executable. A
program the store cannot write or read back (a file cut short, another jax) is traced as usual,
with a warning."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from absl import logging

from transformer_jax import fs


@functools.cache
def _build_key() -> str:
  """What built a program: jax, jaxlib, the devices, XLA_FLAGS and this package's code."""
  digest = hashlib.sha256()
  device = jax.devices()[0]
  for part in (jax.__version__, jax.lib.__version__, device.platform, device.device_kind,
               str(jax.device_count()), os.environ.get("XLA_FLAGS", "")):
    digest.update(part.encode() + b"\0")
  for path in sorted(Path(__file__).parent.rglob("*.py")):
    digest.update(path.read_bytes())
  return digest.hexdigest()


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
  behind the same compile-once lock)."""

  def __init__(self, directory: str | Path | None):
    self.directory = Path(directory) if directory else None

  def jit(self, name: str, describe: str, fn: Callable, **jit_args) -> Callable:
    """jax.jit(fn, **jit_args), its programs kept under `name` and `describe`: a description of
    everything the function closes over (sizes, settings, constants) that its arguments' shapes
    do not say. Threads may call it at once: each program is compiled by one of them."""
    jitted = jax.jit(fn, **jit_args)
    ready: dict[tuple, Callable] = {}  # By signature: the programs compiled (or loaded).
    lock = threading.Lock()

    def call(*args):
      signature = _signature(args)
      program = ready.get(signature)
      if program is not None:
        return program(*args)
      with lock:  # Threads that meet a program first at once: one compiles it, the rest wait.
        program = ready.get(signature)
        if program is None:
          program = (jitted if self.directory is None else
                     self._program(name, describe, signature, jitted, jit_args, args))
          out = program(*args)  # Compiles (or loads) it.
          ready[signature] = program
          return out
      return program(*args)
    return call

  def _program(self, name: str, describe: str, signature: tuple, jitted, jit_args: dict, args):
    key = hashlib.sha256("\0".join((_build_key(), name, describe, repr(signature))).encode())
    path = self.directory / f"{name}-{key.hexdigest()[:40]}.jax_export"
    exported = None
    if path.exists():
      try:
        exported = jax.export.deserialize(bytearray(path.read_bytes()))
      except Exception as e:  # noqa: BLE001 -- a stale or damaged entry is traced again.
        logging.warning("tracing %s again: its kept program %s did not load (%s)", name, path, e)
    if exported is None:
      exported = jax.export.export(jitted)(*args)
      try:
        self.directory.mkdir(parents=True, exist_ok=True)
        fs.replace_file(path, exported.serialize())
      except OSError as e:  # Keeping it is an optimization, never a failure.
        logging.warning("could not keep the traced %s in %s (%s)", name, self.directory, e)
    return jax.jit(exported.call, **jit_args)
