"""Orbax checkpoints of the train state and the data position, saved together."""

from __future__ import annotations

import contextlib
import logging as std_logging
import shutil
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from transformer_jax import errors, sharding
from transformer_jax.errors import UserError


class CheckpointNotFoundError(UserError, FileNotFoundError):
  pass


class CheckpointDamagedError(UserError, RuntimeError):
  """No checkpoint of a directory could be read back and verified."""


class CheckpointWriteError(UserError, OSError):
  """A checkpoint could not be written (the disk is full): earlier checkpoints are intact."""

  def __str__(self) -> str:
    return self.args[0]


_NO_SPACE = ("No space left on device", "os_error_code='28'")


@contextlib.contextmanager
def _writing(directory: Path):
  """Turns a checkpoint write that fails for want of space (tensorstore reports it as a
  RESOURCE_EXHAUSTED ValueError, from orbax's background thread) into one CheckpointWriteError,
  and quiets the echoes of the same failure from the other writes in flight."""
  try:
    yield
  except Exception as e:
    if isinstance(e, UserError) or not any(s in str(e) for s in _NO_SPACE):
      raise
    _drop_echoes(("write_fragment", "_write_array", "async_serialize"))
    raise CheckpointWriteError(
        f"a checkpoint could not be written to {directory}: no space left on device. The "
        "checkpoints before it are intact; free some space and run the same command to go on "
        "from the latest one") from None


class CheckpointMismatchError(UserError, ValueError):
  """A checkpoint that reads back but holds other arrays (names or shapes) than the model it
  is restored into: the checkpoint is intact, the model (its config or tokenizer) differs."""


_WEIGHTS = (np.uint32(2654435761), np.uint32(2246822519))


def fingerprints(tree) -> list:
  """Per leaf, two position-weighted sums of its bits mod 2**32 ([2] uint32). A change of any
  single value changes both; the sums are exact integers, so they depend neither on the
  sharding nor on where they are computed: with numpy where every leaf is already in this
  process's memory (a CPU's arrays: no program to trace and compile at each restore), else
  where the leaves live."""
  leaves = jax.tree.leaves(tree)
  if all(_in_host_memory(x) for x in leaves):
    return [_host_fingerprint(np.asarray(x)) for x in leaves]
  return _device_fingerprints(tree)


def _in_host_memory(x) -> bool:
  """Whether `x` reads as numpy without a copy from a device: a numpy array, or a jax array
  whole on this process's CPU; of 4 bytes an element at most."""
  if isinstance(x, jax.Array):
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices()) and (
        x.dtype.itemsize <= 4)
  return isinstance(x, np.ndarray) and x.dtype.itemsize <= 4


def _bits(x, xp):
  """The leaf's values as uint32 words, flat (numpy or jax.numpy as `xp`)."""
  if x.dtype == xp.bool_ or x.dtype.itemsize == 1:
    bits = x.astype(xp.uint32)
  elif x.dtype.itemsize == 2:
    bits = (x.view(np.uint16) if xp is np else
            jax.lax.bitcast_convert_type(x, jnp.uint16)).astype(xp.uint32)
  else:  # 4 bytes as they are; 8 bytes as two uint32 words.
    bits = x.view(np.uint32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.uint32)
  return bits.reshape(-1)


def _host_fingerprint(x: np.ndarray) -> np.ndarray:
  bits = _bits(np.ascontiguousarray(x), np)
  i = np.arange(bits.size, dtype=np.uint32)
  with np.errstate(over="ignore"):  # Sums mod 2**32, as the device computes them.
    return np.array([np.sum(bits * (i * w + np.uint32(2 * k + 1)), dtype=np.uint32)
                     for k, w in enumerate(_WEIGHTS)], np.uint32)


@jax.jit
def _device_fingerprints(tree) -> list[jax.Array]:
  out = []
  for x in jax.tree.leaves(tree):
    bits = _bits(jnp.asarray(x), jnp)
    i = jnp.arange(bits.size, dtype=jnp.uint32)
    out.append(jnp.stack([jnp.sum(bits * (i * w + np.uint32(2 * k + 1)), dtype=jnp.uint32)
                          for k, w in enumerate(_WEIGHTS)]))
  return out


def fingerprint_dict(tree, prefix: str = "") -> dict[str, list[int]]:
  """{prefix + leaf path: fingerprint} of a pytree, as plain ints (JSON)."""
  paths = [prefix + jax.tree_util.keystr(p)
           for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return {p: [int(v) for v in np.asarray(f)] for p, f in zip(paths, fingerprints(tree))}


def _restored_as_saved(restored, target, saved: dict, prefix: str) -> bool:
  """Whether a partial restore gave the arrays `target` asks for: a checkpoint's metadata
  takes longer to read than its parameters (orbax reads every array's), so a restore is
  checked by what it gave and by the names of the fingerprints saved with it, and the
  metadata is read only to say what differs. orbax (0.12.8) restores an array in its stored
  shape, whatever the target's, and leaves a name it does not hold unrestored."""
  got = jax.tree.leaves(restored)
  wanted = jax.tree.leaves(target)
  if len(got) != len(wanted) or any(
      not isinstance(g, jax.Array) or g.shape != w.shape for g, w in zip(got, wanted)):
    return False
  names = {prefix + jax.tree_util.keystr(p)
           for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
  return names == {k for k in saved if k.startswith(prefix + "[")}


def _leaf_name(path) -> str:
  """A pytree path as orbax names the array: "opt_state.1.0.mu.src_embed.embedding"."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return ".".join(parts)


class Checkpointer:
  """Asynchronous, rotating checkpoints under `directory` (one folder per step).

  Each holds `state` (params, optimizer state, step, dropout key), `data` (the position of
  the global batch stream, a small JSON object that is the same on every host), so a resumed
  run, on any number of hosts, sees the same batches and dropout masks, and `fingerprints` of
  every array of `state`, checked when it is read back: a checkpoint that fails to read or to
  verify is reported by step and the one before it is used.
  """

  def __init__(self, directory: str | Path, save_every: int, keep: int, read_only: bool = False,
               tokenizer_digest: str | None = None):
    """`tokenizer_digest`: the identity of the tokenizers the state belongs with, saved with
    each checkpoint and checked against the one saved before any array is read."""
    self.directory = Path(directory).absolute()
    self.tokenizer_digest = tokenizer_digest
    _drop_abandoned_io_echoes()  # Before the first read or write: either may fail midway.
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=save_every, create=not read_only,
            read_only=read_only, enable_async_checkpointing=not read_only))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, force: bool = False) -> bool:
    """Saves if `step` is on the interval (or `force`); returns whether it did."""
    items = dict(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                 fingerprints=ocp.args.JsonSave(fingerprint_dict(state)))
    if self.tokenizer_digest:
      items["tokenizer"] = ocp.args.JsonSave({"sha256": self.tokenizer_digest})
    with _writing(self.directory):  # The previous save's failure surfaces here.
      return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def check_tokenizer(self, step: int) -> None:
    """Raises CheckpointMismatchError where the checkpoint was saved with other tokenizers than
    this checkpointer's (one saved before tokenizers were recorded is not checked)."""
    if not self.tokenizer_digest or not (self.directory / str(step) / "tokenizer").exists():
      return
    saved = self.manager.restore(step, args=ocp.args.Composite(
        tokenizer=ocp.args.JsonRestore())).tokenizer
    if saved.get("sha256") != self.tokenizer_digest:
      raise CheckpointMismatchError(
          f"the checkpoint of step {step} in {self.directory} is intact but was trained with "
          "another tokenizer: the workdir's tokenizer file is not the one its checkpoints were "
          "trained with (same size or not). Nothing was changed on disk")

  def restore_latest(self, state_like, state_shardings) -> tuple[int, object, dict] | None:
    """(step, state, data position) of the newest checkpoint that reads back and verifies;
    None where there is no checkpoint. Damaged ones are reported, renamed `damaged-STEP` (so
    that rotation never deletes a good one in their favour) and passed over.

    Raises:
      CheckpointDamagedError: every checkpoint is damaged.
      CheckpointMismatchError: the newest readable checkpoint holds another model's arrays.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        state, data = self.restore(step, state_like, state_shardings)
        self.verify(step, state)
        return step, state, data
      except CheckpointMismatchError:
        raise  # Intact: another model's. Nothing is renamed.
      except Exception as e:  # Any failure to read or verify: this checkpoint is unusable.
        self._report_damaged(step, e)
        self._set_aside(step)
    if steps:
      raise CheckpointDamagedError(
          f"every checkpoint in {self.directory} is damaged (steps {sorted(steps)}, now "
          "renamed damaged-STEP); delete the directory to start again")
    return None

  def restore(self, step: int, state_like, state_shardings) -> tuple[object, dict]:
    """(state restored into `state_shardings`, data position) of a checkpoint.

    Args:
      state_like: a state (or abstract state) with the structure, shapes and dtypes to restore.
    """
    self._check_step(step)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state_like, state_shardings)
    self.check_fits(step, target)
    self.check_tokenizer(step)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def restore_params_latest(self, boxed_params_like, mesh,
                            key: str = "params") -> tuple[int, object]:
    """(step, params) of the newest checkpoint whose parameters read back and verify; damaged
    ones are reported and passed over (nothing on disk is changed).

    Raises:
      CheckpointNotFoundError: there is no checkpoint.
      CheckpointDamagedError: every checkpoint is damaged.
      CheckpointMismatchError: the newest readable checkpoint holds another model's arrays.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
    for step in steps:
      try:
        return step, self.restore_params(step, boxed_params_like, mesh, key)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # Any failure to read or verify: this checkpoint is unusable.
        self._report_damaged(step, e)
    raise CheckpointDamagedError(f"every checkpoint in {self.directory} is damaged "
                                 f"(steps {sorted(steps)})")

  def restore_params(self, step: int, boxed_params_like, mesh, key: str = "params",
                     via_host: bool | None = None):
    """Only the parameters of a checkpoint (no optimizer state), sharded over `mesh` by their
    logical axis names, verified against its fingerprints.

    Args:
      boxed_params_like: abstract parameters still boxed with logical axis names.
      key: "params", or "ema_params" for their moving average (where the run kept one).
      via_host: read every array into this host's memory, verify it there and put the whole
        tree onto `mesh` at once. Default: where `mesh` is one process's accelerators. On a GPU
        that is faster in a new process than orbax placing each array as it reads it and
        fingerprints traced for the device.
    """
    self._check_step(step)
    if via_host is None:
      via_host = all(d.process_index == jax.process_index() and d.platform != "cpu"
                     for d in mesh.devices.flat)
    if via_host:
      host_mesh = sharding.make_mesh((1, 1, 1), jax.local_devices(backend="cpu")[:1])
      params = self.restore_params(step, boxed_params_like, host_mesh, key, via_host=False)
      return jax.device_put(params, sharding.logical_shardings(boxed_params_like, mesh))
    shardings = sharding.logical_shardings(boxed_params_like, mesh)
    target = {key: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed_params_like), shardings)}
    saved = self._saved_fingerprints(step)
    if saved is None:  # Nothing to compare the names with: the checkpoint's metadata, first.
      self.check_fits(step, target)
    try:
      self.check_tokenizer(step)
    except CheckpointMismatchError:
      self.check_fits(step, target)  # Another vocabulary: the arrays say which.
      raise
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True))).state[key]
    except Exception:
      self.check_fits(step, target)  # Another model's arrays may fail to read: say so.
      raise
    if saved is not None and not _restored_as_saved(restored, target[key], saved, "." + key):
      self.check_fits(step, target)  # Raises, naming what differs.
    self.verify(step, restored, prefix="." + key, saved=saved)
    return restored

  def check_fits(self, step: int, target) -> None:
    """Raises CheckpointMismatchError where the arrays of `target` (the state, or a part of it
    such as {"params": ...}) are not the checkpoint's: a name missing from either, or another
    shape. Reads the checkpoint's metadata only; a metadata file that cannot be read raises as
    any other read failure (damage)."""
    stored = self._stored_shapes(step)
    wanted = {_leaf_name(p): tuple(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    parts = {name.split(".")[0] for name in wanted}  # A partial restore compares its parts.
    stored = {k: v for k, v in stored.items() if k.split(".")[0] in parts}
    rank = {"params": 0, "ema_params": 1}  # The model's parameters are named first.
    order = lambda k: (rank.get(k.split(".")[0], 2), k)
    diffs = [f"{k} is {stored[k]} there, {wanted[k]} in the model"
             for k in sorted(wanted, key=order) if k in stored and stored[k] != wanted[k]]
    diffs += [f"{k} is missing there" for k in sorted(set(wanted) - set(stored), key=order)]
    diffs += [f"{k} is there, not in the model"
              for k in sorted(set(stored) - set(wanted), key=order)]
    if not diffs:
      return
    embeddings = [k for k in sorted(wanted, key=order) if k.endswith("embedding")
                  and not k.endswith("position_embedding")
                  and k in stored and stored[k][0] != wanted[k][0]]
    if embeddings:  # An embedding's rows are the vocabulary, padded to a multiple of 128.
      k = embeddings[0]
      raise CheckpointMismatchError(
          f"the checkpoint of step {step} in {self.directory} is intact but was trained with "
          f"another vocabulary: {k} has {stored[k][0]} rows there, {wanted[k][0]} from the "
          "workdir's tokenizer (sizes padded to a multiple of 128); the tokenizer files are not "
          "the ones its checkpoints were trained with. Nothing was changed on disk")
    more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
    raise CheckpointMismatchError(
        f"the checkpoint of step {step} in {self.directory} is intact but holds another "
        f"model's arrays: {diffs[0]}{more}. Nothing was changed on disk")

  def _stored_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """{leaf name: shape} of a checkpoint's state, from its metadata."""
    metadata = ocp.PyTreeCheckpointHandler().metadata(self.directory / str(step) / "state")
    tree = getattr(metadata, "tree", metadata)
    return {_leaf_name(p): tuple(m.shape)
            for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}

  def _saved_fingerprints(self, step: int) -> dict[str, list[int]] | None:
    """The fingerprints saved with a checkpoint; None for one written before they existed."""
    if not (self.directory / str(step) / "fingerprints").exists():
      return None
    return self.manager.restore(step, args=ocp.args.Composite(
        fingerprints=ocp.args.JsonRestore())).fingerprints

  def verify(self, step: int, tree, prefix: str = "", saved: dict | None = None) -> None:
    """Raises ValueError where `tree`'s arrays (the state, or its part at `prefix`) differ from
    the fingerprints saved with them (`saved`: those, where already read)."""
    saved = saved or self._saved_fingerprints(step)
    if saved is None:  # Written before fingerprints existed: nothing to check against.
      logging.warning("The checkpoint of step %d has no fingerprints: not verified", step)
      return
    got = fingerprint_dict(tree, prefix)  # A part of the state: its paths carry `prefix`.
    bad = [k for k, v in got.items() if saved.get(k) != v]
    if bad:
      raise ValueError(f"{len(bad)} arrays differ from their fingerprints, e.g. {bad[0]}")

  def _report_damaged(self, step: int, error: Exception) -> None:
    logging.warning("The checkpoint of step %d in %s is damaged (%s); trying the one before it",
                    step, self.directory,
                    f"{type(error).__name__}: {errors.first_line(error)[:200]}")

  def _set_aside(self, step: int) -> None:
    """Renames a damaged checkpoint out of the manager's sight (process 0 only)."""
    if jax.process_index() == 0:
      source, target = self.directory / str(step), self.directory / f"damaged-{step}"
      if source.exists():
        if target.exists():
          shutil.rmtree(target)
        source.rename(target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    self.manager.reload()

  def _check_step(self, step: int) -> None:
    if step not in self.manager.all_steps():
      raise CheckpointNotFoundError(
          f"no checkpoint for step {step} in {self.directory} "
          f"(found: {sorted(self.manager.all_steps()) or 'none'})")

  def wait(self) -> None:
    """Blocks until the checkpoint being written is on disk."""
    with _writing(self.directory):
      self.manager.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


_ABANDONED_IO_ERRORS = ("Event loop is closed", "Encountered error while reading array index")


def _drop_abandoned_io_echoes() -> None:
  """Quiets the echoes of a read that fails on a damaged checkpoint, or a write that fails on
  a full disk (each reported once, as a warning or an error line).

  The read or write stops at the first array that fails; orbax then closes its event loop
  while tensorstore finishes the others, and each of them reports the closed loop or the same
  damage through `sys.unraisablehook` (with no object: a bare traceback), or leaves a
  coroutine never awaited, or a task whose exception asyncio's logger reports as never
  retrieved (with its traceback), at any later time: during training, before the failure
  reaches the main thread, or at exit, after a command's error line. Exactly those are dropped.
  """
  if _drop_unraisable("abandoned reads and writes",
                      lambda u: str(u.exc_value).startswith(_ABANDONED_IO_ERRORS)):
    warnings.filterwarnings("ignore", "coroutine '_read_array_index_and_device_put' was never "
                            "awaited", RuntimeWarning)
    std_logging.getLogger("asyncio").addFilter(_not_an_abandoned_io_echo)


def _not_an_abandoned_io_echo(record: std_logging.LogRecord) -> bool:
  """A logging filter: False for a record of one of an abandoned read's or write's errors."""
  error = record.exc_info[1] if record.exc_info else None
  return error is None or not str(error).startswith(_ABANDONED_IO_ERRORS)


def _drop_echoes(names: tuple[str, ...]) -> None:
  """Quiets the echoes of a write that failed (and is reported once as an error line): the
  other writes in flight fail alike, or are collected at exit unfinished, and each would print
  its traceback through `sys.unraisablehook` or asyncio's logger."""
  _drop_unraisable("failed writes", lambda u: any(n in repr(u.object) for n in names))
  std_logging.getLogger("asyncio").setLevel(std_logging.CRITICAL)


def _drop_unraisable(kind: str, drop) -> bool:
  """Puts a `sys.unraisablehook` in place that drops what `drop(unraisable)` picks and passes
  every other unraisable exception to the hook before it; once per `kind`. Returns whether it
  was put in place now."""
  previous = sys.unraisablehook
  if kind in getattr(previous, "drops", ()):
    return False

  def hook(unraisable):
    if not drop(unraisable):
      previous(unraisable)

  hook.drops = (*getattr(previous, "drops", ()), kind)
  sys.unraisablehook = hook
  return True
