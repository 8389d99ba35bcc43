"""Device mesh and logical-axis rules: the only module that knows about devices.

The mesh has three axes: `data` (pure data parallelism), `fsdp` (data parallelism whose
parameters and optimizer state are split along their `embed` dimension) and `tensor`
(heads, FFN hidden units and the vocabulary split across devices).

| logical name | mesh axis        |
|--------------|------------------|
| batch        | (data, fsdp)     |
| embed        | fsdp             |
| heads        | tensor           |
| mlp          | tensor           |
| vocab        | tensor           |
| kv, length, act_embed, layers | replicated |
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("layers", None),
    ("length", None),
    ("act_embed", None),
)


def mesh_shape(shape: Sequence[int], num_devices: int | None = None) -> tuple[int, ...]:
  """Resolves one -1 entry to use all devices; raises if the product does not match."""
  n = jax.device_count() if num_devices is None else num_devices
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f"mesh_shape must have {len(MESH_AXES)} entries {MESH_AXES}, got {shape}")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh_shape may hold at most one -1, got {shape}")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if n % known:
      raise ValueError(f"mesh_shape {shape} does not divide the {n} devices")
    shape = tuple(n // known if s == -1 else s for s in shape)
  if int(np.prod(shape)) != n:
    raise ValueError(f"mesh_shape {shape} needs {int(np.prod(shape))} devices, found {n}")
  return shape


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all hosts)."""
  devices = jax.devices() if devices is None else list(devices)
  return jax.make_mesh(mesh_shape(shape, len(devices)), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_shardings(boxed_tree, mesh: Mesh, rules=LOGICAL_RULES):
  """NamedShardings for a tree of (abstract) values boxed with logical axis names."""
  # A box around no array (optax's MaskedNode: the parameters one part of Muon's partitioned
  # state leaves to the other) is no leaf: unboxed, it holds nothing to place.
  boxed_tree = jax.tree.map(
      lambda x: x.unbox() if isinstance(x, nn.Partitioned) and not jax.tree.leaves(x.unbox())
      else x, boxed_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading axis split over every data-parallel device."""
  return NamedSharding(mesh, P(("data", "fsdp")))


def data_parallel_size() -> int:
  """Devices the batch is split over (data x fsdp) in the mesh being traced with
  (`mesh_context`); 1 outside one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
    return 1
  return mesh.shape["data"] * mesh.shape["fsdp"]


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each host's slice of the batch into one global, batch-sharded array."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}


def axis_rules():
  """Context that makes `nn.with_logical_constraint` in the model use this module's rules."""
  return nn.logical_axis_rules(LOGICAL_RULES)


@contextlib.contextmanager
def mesh_context(mesh: Mesh):
  """Makes `mesh` and the logical rules current, for tracing jitted steps and init."""
  with jax.set_mesh(mesh), axis_rules():
    yield
