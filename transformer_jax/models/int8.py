"""int8 weights for decoding: every matrix product of a trained model's layers in int8 with int32
sums, CTranslate2's int8 scheme (weights quantized once per output channel, activations per row
at each product).

`quantize(params)` gives the tree a model decodes with: each kernel that a product reads (the
attention's query/key/value/output kernels, the feed-forward's, the token table that the tied
output projection reads) replaced by its int8 values beside a float32 `<name>_scale` leaf of one
scale per output channel; biases, norms and the rest stay float32. The modules find the scale
leaf (`scale_of`) and multiply in int8 (`matmul`); a tree without scales computes as before. On
2 cores of an Intel Xeon with VNNI, [128, 256] x [256, 1024] took 0.28 ms in int8 (the
activations' quantization included) against 0.60 ms in float32, and the projection onto 8,000
pieces 0.65 against 2.28 ms (benchmarks/decode_profile.py measures them on a model).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# The leaves quantized, by name, and the axes of each that a product contracts (its input
# features): the scale has the shape of the axes left, one per output channel.
CONTRACTED = {"query_kernel": (0,), "key_kernel": (0,), "value_kernel": (0,),
              "out_kernel": (0, 1), "kernel": (0,), "embedding": (1,)}
# Modules whose "kernel" is quantized: the feed-forward's two layers (an untied output
# projection, a pooler or a classifier stay float32).
DENSE_MODULES = ("wi", "wo")


def _scaled(kernel: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """kernel -> (int8 values of its shape, float32 scales over the axes not in `axes`)."""
  kernel = kernel.astype(jnp.float32)
  scale = jnp.max(jnp.abs(kernel), axis=axes, keepdims=True) / 127.0
  scale = jnp.where(scale == 0, 1.0, scale)
  values = jnp.clip(jnp.round(kernel / scale), -127, 127).astype(jnp.int8)
  return values, jnp.squeeze(scale, axis=axes)


def quantize(params: dict[str, Any], table: str | None = None) -> dict[str, Any]:
  """The parameters with their products' kernels in int8 (the module docstring). `table`: the
  name of the token-table module the output projection reads (a tied model's: its embedding is
  quantized too, its lookups dequantized); None leaves every table float32."""
  def walk(tree, name):
    out = {}
    for key, value in tree.items():
      if isinstance(value, dict):
        out[key] = walk(value, key)
        continue
      owner = {"kernel": DENSE_MODULES, "embedding": (table,)}.get(key)
      quantized = key in CONTRACTED and (owner is None or name in owner)
      if quantized and value.dtype != jnp.int8:
        out[key], out[f"{key}_scale"] = _scaled(value, CONTRACTED[key])
      else:
        out[key] = value
    return out
  return walk(dict(params), None)


def scale_of(module, name: str) -> jax.Array | None:
  """The scale leaf of `module`'s parameter `name` in an int8 tree, or None (float weights)."""
  scale = f"{name}_scale"
  return module.get_variable("params", scale) if module.has_variable("params", scale) else None


def matmul(x: jax.Array, values: jax.Array, scale: jax.Array, contract: int) -> jax.Array:
  """x [..., K] times int8 `values` (the K axis at `contract`: 0 for [K, N], 1 for [N, K]) with
  per-channel `scale` [N] -> [..., N] float32. x is quantized per row (its largest magnitude to
  127), the product summed in int32, and both scales applied to the sums."""
  lead, k = x.shape[:-1], x.shape[-1]
  x = x.reshape(-1, k).astype(jnp.float32)
  row = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
  row = jnp.where(row == 0, 1.0, row)
  xq = jnp.round(x / row).astype(jnp.int8)
  sums = lax.dot_general(xq, values.reshape(k, -1) if contract == 0 else values,
                         (((1,), (contract,)), ((), ())), preferred_element_type=jnp.int32)
  return (sums.astype(jnp.float32) * row * scale.reshape(1, -1)).reshape(*lead, -1)
