"""Orbax checkpoints of the train state and the data position, saved together."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import orbax.checkpoint as ocp

from transformer_jax import sharding


class CheckpointNotFoundError(FileNotFoundError):
  pass


class Checkpointer:
  """Asynchronous, rotating checkpoints under `directory` (one folder per step).

  Each holds `state` (params, optimizer state, step, dropout key) and `data` (the position of
  the global batch stream, a small JSON object that is the same on every host), so a resumed
  run, on any number of hosts, sees the same batches and dropout masks.
  """

  def __init__(self, directory: str | Path, save_every: int, keep: int, read_only: bool = False):
    self.directory = Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=save_every, create=not read_only,
            read_only=read_only, enable_async_checkpointing=not read_only))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, force: bool = False) -> bool:
    """Saves if `step` is on the interval (or `force`); returns whether it did."""
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def restore(self, step: int, state_like, state_shardings) -> tuple[object, dict]:
    """(state restored into `state_shardings`, data position) of a checkpoint.

    Args:
      state_like: a state (or abstract state) with the structure, shapes and dtypes to restore.
    """
    self._check_step(step)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state_like, state_shardings)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return restored.state, restored.data

  def restore_params(self, step: int, boxed_params_like, mesh):
    """Only the parameters of a checkpoint (no optimizer state), sharded over `mesh` by their
    logical axis names.

    Args:
      boxed_params_like: abstract parameters still boxed with logical axis names.
    """
    self._check_step(step)
    shardings = sharding.logical_shardings(boxed_params_like, mesh)
    target = {"params": jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed_params_like), shardings)}
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
    return restored.state["params"]

  def _check_step(self, step: int) -> None:
    if step not in self.manager.all_steps():
      raise CheckpointNotFoundError(
          f"no checkpoint for step {step} in {self.directory} "
          f"(found: {sorted(self.manager.all_steps()) or 'none'})")

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
