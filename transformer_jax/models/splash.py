"""Splash attention (jax's Pallas kernel for TPUs) on packed rows: the mask is read from segment
ids and a causal flag, block by block; no [B, 1, T, S] mask is built, and blocks that the mask
hides entirely (across segments, above the diagonal) are skipped.

The kernel attends one example at a time, [N, L, H]: it is vmapped over the batch and, inside a
mesh context (`sharding.mesh_context`), run on each device's share under shard_map, the batch
split over (data, fsdp) and the heads over tensor, as the model's logical axes place them (XLA
does not partition a Pallas kernel itself). `interpret=True` runs it in Pallas's interpreter
(CPU tests).

Shapes: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

BLOCK = 128  # The kernel's default query and key block: lengths must be multiples of it.
_BATCH, _HEADS = ("data", "fsdp"), "tensor"


def fits(q_len: int, kv_len: int) -> bool:
  """Whether the kernel's blocks tile these lengths (else the model uses XLA's attention)."""
  return q_len % BLOCK == 0 and kv_len % BLOCK == 0


def _libraries():
  """jax's splash kernel and mask modules, imported when first needed, not with this module:
  they take 0.06 s to import, and only a TPU (or a test of the kernel) runs them."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
      splash_attention_kernel, splash_attention_mask)
  return splash_attention_kernel, splash_attention_mask


def _kernel(heads: int, q_len: int, kv_len: int, causal: bool, interpret: bool):
  """The kernel for one example's [heads, length, H] (its mask's block map is computed here,
  while tracing: built anew for each trace, as it holds arrays of that trace)."""
  kernel_lib, mask_lib = _libraries()
  one = mask_lib.CausalMask((q_len, kv_len)) if causal else mask_lib.FullMask((q_len, kv_len))
  return kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([one] * heads), head_shards=1,
                                    q_seq_shards=1, interpret=interpret)


def attention(q, k, v, q_segments, kv_segments, causal: bool, interpret: bool = False):
  """q: [B, T, N, H], k, v: [B, S, N, H], q_segments: [B, T], kv_segments: [B, S] (0: padding)
  -> [B, T, N, H]: softmax(q k^T / sqrt(H)) v over the keys of the query's segment (and not
  after it where `causal`). A padding query attends to the padding keys (its output is unused)."""
  head_dim = q.shape[-1]
  q = q * jnp.asarray(1.0 / np.sqrt(head_dim), q.dtype)  # The kernel does not scale.
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, L, N, H] -> [B, N, L, H]

  def local(q, k, v, q_segments, kv_segments):  # This device's rows and heads.
    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], causal, interpret)
    segment_ids = _libraries()[0].SegmentIds
    one = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=segment_ids(qs, ks))
    return jax.vmap(one)(q, k, v, q_segments, kv_segments)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not {*_BATCH, _HEADS} <= set(mesh.axis_names):
    out = local(q, k, v, q_segments, kv_segments)
  else:
    heads, rows = P(_BATCH, _HEADS), P(_BATCH)
    out = jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, rows, rows),
                        out_specs=heads, check_vma=False)(q, k, v, q_segments, kv_segments)
  return jnp.swapaxes(out, 1, 2)  # [B, N, T, H] -> [B, T, N, H]
