"""Multi-head attention and its masks.

Masks come from segment ids: 0 marks padding, and tokens attend only within their own segment.
An unpacked batch has segment id 1 on every real token, which is d2l's valid-length mask; a
packed batch has 1, 2, 3, ... for the sentences sharing a row. `attention_impl` picks whose
kernel computes it (XLA's, cuDNN's fused one, splash attention on TPUs).

Einsum legend: B batch, T target (query) length, S source (key) length, N heads, H head dim,
D model dim.
"""

from __future__ import annotations


import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.models import int8, splash
from transformer_jax.models.common import TransformerConfig, xavier_init


def attention_impl(requested: str | None, dtype: str, head_dim: int,
                   platform: str | None = None) -> str | None:
  """`auto` picks cuDNN's fused attention where it applies (an NVIDIA GPU, bfloat16, head dim a
  multiple of 8 up to 128), splash attention on TPUs (segment ids instead of a dense mask,
  where the lengths are multiples of its 128-token blocks; XLA's otherwise), and XLA's
  elsewhere. `platform`: the one the program is compiled for ("gpu", "tpu", "cpu"); default:
  this process's backend."""
  if requested != "auto":
    return requested
  if platform is None:
    platform = jax.default_backend()
  if platform == "tpu":
    return "splash"
  cudnn_ok = (platform in ("gpu", "cuda") and dtype == "bfloat16"
              and head_dim % 8 == 0 and head_dim <= 128)
  return "cudnn" if cudnn_ok else "xla"


@flax.struct.dataclass
class SegmentMask:
  """Which keys each query may attend to, kept as segment ids (0: padding): the same
  non-padding segment, and not the future where causal. `dense()` builds the [B, 1, T, S]
  boolean mask for the attentions that take one; splash attention reads the ids.

  `by_lengths` (model.attention_mask="lengths"): every row holds one segment from position 0,
  padding after it, so the mask is the causal flag and each row's length: cuDNN then applies
  its own (padding-)causal mask type, with no [B, 1, T, S] bias read from memory."""
  q: jax.Array  # [B, T]
  kv: jax.Array  # [B, S]
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  by_lengths: bool = flax.struct.field(pytree_node=False, default=False)

  def lengths(self) -> tuple[jax.Array, jax.Array]:
    """([B], [B]) int32: the real tokens of each query row and key row."""
    count = lambda ids: jnp.sum(ids > 0, axis=1, dtype=jnp.int32)
    return count(self.q), count(self.kv)

  def dense(self) -> jax.Array:
    """[B, 1, T, S] boolean."""
    mask = (self.q[:, :, None] == self.kv[:, None, :]) & (self.kv[:, None, :] > 0)
    if self.causal:
      mask &= jnp.tril(jnp.ones((self.q.shape[1], self.kv.shape[1]), dtype=bool))
    return mask[:, None]


class MultiHeadAttention(nn.Module):
  """Multi-head attention with einsum projections (kernels created in their 3-D shapes)."""
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    n, h, d = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.d_model
    for name in ("query", "key", "value"):
      setattr(self, f"{name}_kernel",
              self.param(f"{name}_kernel", xavier_init(("embed", "heads", "kv")), (d, n, h)))
      if cfg.attention_bias:
        setattr(self, f"{name}_bias", self.param(f"{name}_bias", nn.with_logical_partitioning(
            nn.initializers.zeros, ("heads", "kv")), (n, h)))
    self.out_kernel = self.param("out_kernel", xavier_init(("heads", "kv", "embed")), (n, h, d))
    if cfg.attention_bias:
      self.out_bias = self.param("out_bias", nn.with_logical_partitioning(
          nn.initializers.zeros, ("embed",)), (d,))

  def project(self, x, *names: str):
    """x: [B, L, D] -> one [B, L, N, H] array per name (query, key or value).

    Separate einsums, not one over stacked kernels: inside a decoding loop XLA would copy the
    stacked kernel at every step."""
    dt = self.cfg.compute_dtype
    out = []
    for name in names:
      kernel, scale = getattr(self, f"{name}_kernel"), int8.scale_of(self, f"{name}_kernel")
      if scale is not None:  # int8 weights (decoding: models/int8.py).
        y = int8.matmul(x, kernel, scale, contract=0).reshape(*x.shape[:-1], *kernel.shape[1:])
        y = y.astype(dt)
      else:
        y = jnp.einsum("bld,dnh->blnh", x.astype(dt), kernel.astype(dt))
      if self.cfg.attention_bias:
        y = y + getattr(self, f"{name}_bias").astype(dt)
      out.append(nn.with_logical_constraint(y, ("batch", "length", "heads", "kv")))
    return tuple(out)

  def attend(self, q, k, v, mask: SegmentMask):
    """q: [B, T, N, H], k, v: [B, S, N, H] -> [B, T, D]."""
    cfg = self.cfg
    impl = attention_impl(cfg.attention_impl, cfg.dtype, q.shape[-1])
    if cfg.attention_weights:
      logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
      logits = jnp.where(mask.dense(), logits / np.sqrt(q.shape[-1]), jnp.finfo(jnp.float32).min)
      weights = jax.nn.softmax(logits, axis=-1)  # [B, N, T, S]
      self.sow("intermediates", "attention_weights", weights)
      out = jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype), v)
    elif impl == "splash" and splash.fits(q.shape[1], k.shape[1]):
      out = splash.attention(q, k, v, mask.q, mask.kv, mask.causal, cfg.interpret_kernels)
    else:
      impl = "xla" if impl == "splash" else impl  # Lengths splash's blocks do not tile.
      if mask.by_lengths:
        q_len, kv_len = mask.lengths()
        out = jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal,
                                           query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                                           implementation=impl)
      else:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask.dense(), implementation=impl)
    return self.output(out)

  def attend_heads(self, q, k, v, mask):
    """`attend` with keys and values head-major, k, v: [B, N, S, H] (decoding's cached layout:
    the attention contracts them as they lie, with no per-step transposition of the cache).
    The arithmetic of jax.nn.dot_product_attention's XLA implementation."""
    logits = jnp.einsum("btnh,bnsh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = logits * jnp.array(1.0 / np.sqrt(q.shape[-1]), logits.dtype)
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(logits.dtype).max)  # [B, N, T, S]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(k.dtype)
    if self.cfg.attention_weights:
      self.sow("intermediates", "attention_weights", probs)
    # Contracted into [B, N, T, H], then swapped: on a CPU, with a beam's T = K queries a
    # source, several times faster than writing [B, T, N, H] from the contraction itself.
    return self.output(jnp.swapaxes(jnp.einsum("bnts,bnsh->bnth", probs, v), 1, 2))

  def output(self, out):
    """The heads' outputs [B, T, N, H] -> [B, T, D] through the output projection."""
    dt = self.cfg.compute_dtype
    # [B, T, N, H] -> [B, T, D] as one 2-D contraction over N*H (no per-call kernel copy on CPU).
    b, t, n, h = out.shape
    scale = int8.scale_of(self, "out_kernel")
    if scale is not None:
      y = int8.matmul(out.reshape(b, t, n * h), self.out_kernel, scale, contract=0).astype(dt)
    else:
      y = jnp.einsum("btk,kd->btd", out.reshape(b, t, n * h),
                     self.out_kernel.astype(dt).reshape(n * h, -1))
    if self.cfg.attention_bias:
      y = y + self.out_bias.astype(dt)
    return y

  def __call__(self, x_q, x_kv, mask: SegmentMask):
    """x_q: [B, T, D], x_kv: [B, S, D] -> [B, T, D]."""
    (q,), (k, v) = self.project(x_q, "query"), self.project(x_kv, "key", "value")
    return self.attend(q, k, v, mask)
