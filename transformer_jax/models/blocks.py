"""The blocks of the d2l.ai chapter and their stacks: the feed-forward network, the residual
Add&Norm sublayer (post-LN as the paper, or pre-LN), the encoder block (self-attention, FFN) and
the decoder block (causal self-attention, cross-attention where there is a source, FFN, and the
one-token step over a preallocated cache), stacked unrolled (encoder_0, ...) or scanned
(one [layers, ...] array a parameter, model.scan_layers) with optional rematerialization.

Einsum legend: B batch, T target length, S source length, N heads, H head dim, D model dim.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax.models import int8
from transformer_jax.models.attention import MultiHeadAttention
from transformer_jax.models.common import TransformerConfig, xavier_init


REMAT_POLICIES = {"none": None, "full": None,
                  "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims}


def gelu_erf(x):
  """GELU's exact form as BERT and PyTorch write it, x/2 (1 + erf(x / sqrt 2)). jax.nn.gelu
  writes it with erfc, which XLA:CPU expands into exp-based series under a select: on a
  [4096, 1024] array its forward takes 2.5x the time and its gradient 1.35x (the same to 1e-6;
  the masked language model's CPU step 2% less)."""
  return 0.5 * x * (1.0 + lax.erf(x * np.sqrt(0.5).astype(x.dtype)))


def activation(cfg: TransformerConfig):
  """The FFN's nonlinearity: ReLU, GELU in its exact (erf) form as BERT has it, or GELU's tanh
  approximation as GPT-2 has it."""
  if cfg.activation == "relu":
    return nn.relu
  if cfg.activation == "gelu_tanh":
    return functools.partial(nn.gelu, approximate=True)
  return gelu_erf


class Dense(nn.Module):
  """nn.Dense's layer and parameters ("kernel" [K, N], "bias" [N]), multiplying in int8 where
  the tree gives its kernel as int8 values and scales (decoding: models/int8.py)."""
  features: int
  cfg: TransformerConfig
  axes: tuple[str, str]

  @nn.compact
  def __call__(self, x):
    dt = self.cfg.compute_dtype
    kernel = self.param("kernel", xavier_init(self.axes), (x.shape[-1], self.features))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                           self.axes[1:]), (self.features,))
    scale = int8.scale_of(self, "kernel")
    if scale is not None:
      return (int8.matmul(x, kernel, scale, contract=0) + bias).astype(dt)
    x, kernel, bias = x.astype(dt), kernel.astype(dt), bias.astype(dt)
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + bias


class FeedForward(nn.Module):
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic: bool):
    cfg = self.cfg
    h = Dense(cfg.ffn_dim, cfg, ("embed", "mlp"), name="wi")(x)  # [B, L, F]
    h = nn.with_logical_constraint(activation(cfg)(h), ("batch", "length", "mlp"))
    return Dense(cfg.d_model, cfg, ("mlp", "embed"), name="wo")(h)  # [B, L, D]


class Sublayer(nn.Module):
  """Add&Norm around one sublayer: post-LN `LN(x + drop(f(x)))` or pre-LN `x + drop(f(LN(x)))`."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, f, deterministic: bool):
    cfg = self.cfg
    norm = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.compute_dtype, name="norm",
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))
    drop = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)
    if cfg.pre_ln:
      return x + drop(f(norm(x)))
    return norm(x + drop(f(x)))


class EncoderBlock(nn.Module):
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, mask, deterministic: bool):
    cfg = self.cfg
    attn = MultiHeadAttention(cfg, name="self_attention")
    x = Sublayer(cfg, name="attention_sublayer")(x, lambda y: attn(y, y, mask), deterministic)
    ffn = FeedForward(cfg, name="ffn")
    x = Sublayer(cfg, name="ffn_sublayer")(x, lambda y: ffn(y, deterministic), deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))


class DecoderBlock(nn.Module):
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self.self_attention = MultiHeadAttention(cfg)
    self.self_attention_sublayer = Sublayer(cfg)
    if cfg.cross_attention:
      self.cross_attention = MultiHeadAttention(cfg)
      self.cross_attention_sublayer = Sublayer(cfg)
    self.ffn = FeedForward(cfg)
    self.ffn_sublayer = Sublayer(cfg)

  def _cross_and_ffn(self, y, cross_attend, deterministic):
    if self.cfg.cross_attention:
      y = self.cross_attention_sublayer(y, cross_attend, deterministic)
    y = self.ffn_sublayer(y, lambda z: self.ffn(z, deterministic), deterministic)
    return nn.with_logical_constraint(y, ("batch", "length", "act_embed"))

  def __call__(self, y, memory, self_mask, cross_mask, deterministic: bool):
    """Teacher-forced: y [B, T, D], memory [B, S, D] -> [B, T, D]. Without cross-attention
    (a language model) memory and cross_mask are None."""
    y = self.self_attention_sublayer(
        y, lambda z: self.self_attention(z, z, self_mask), deterministic)
    return self._cross_and_ffn(
        y, lambda z: self.cross_attention(z, memory, cross_mask), deterministic)

  def cross_kv(self, memory):
    """memory [B, S, D] -> cross-attention keys and values, head-major [B, N, S, H], once per
    source."""
    return tuple(jnp.swapaxes(x, 1, 2) for x in self.cross_attention.project(memory, "key",
                                                                              "value"))

  def step(self, y, cache, cross, index, cross_mask):
    """C decoding positions from `index` on: y [B*K, C, D] (K rows per source: beams; C = 1
    while decoding, more where a language model reads a prompt) -> ([B*K, C, D], cache with
    these positions' k, v).

    cache: {"k", "v": [B*K, N, L, H]} this block's self-attention keys/values of the positions
    so far; index: the first position, scalar (every row's; index + C <= L) or [B*K] (each
    row's own: decoding slots; positions past L are not written, and what they compute is
    no output); cross: {"k", "v": [B, N, S, H]} its cross-attention keys/values, one per source
    (the K rows of a source attend to them as K query positions: nothing is tiled or
    reordered); cross_mask: [B, 1, 1, S] (cross and cross_mask None without cross-attention).
    Keys and values lie head-major, as the attention contracts them (`attend_heads`).
    """
    new = dict(cache)
    width = y.shape[1]

    def self_attend(z):  # z: [B*K, C, D]
      q, k, v = self.self_attention.project(z, "query", "key", "value")  # [B*K, C, N, H] each
      positions = jnp.arange(cache["k"].shape[2])
      for name, kv in (("k", k), ("v", v)):  # Write these positions into the preallocated cache.
        kv = kv.astype(cache[name].dtype)
        if index.ndim == 0:  # The same positions for every row.
          new[name] = lax.dynamic_update_slice(cache[name], jnp.swapaxes(kv, 1, 2),
                                               (0, 0, index, 0))
        elif width == 1:  # Each row its own position (decoding slots): [B*K].
          rows = jnp.arange(kv.shape[0])
          new[name] = cache[name].at[rows, :, index].set(kv[:, 0], mode="promise_in_bounds")
        else:  # Each row its own C positions: [B*K, C], those past the cache dropped.
          rows = jnp.arange(kv.shape[0])[:, None]
          at = index[:, None] + jnp.arange(width)
          new[name] = cache[name].at[rows, :, at].set(kv, mode="drop")  # kv [B*K, C, N, H]
      # [1 or B*K, C, L]: query c sees the keys up to its own position.
      queries = jnp.reshape(index, (-1, 1)) + jnp.arange(width)
      filled = positions[None, None, :] <= queries[:, :, None]
      return self.self_attention.attend_heads(q, new["k"], new["v"], filled[:, None])

    def cross_attend(z):  # z: [B*K, C, D]
      (q,) = self.cross_attention.project(z, "query")  # [B*K, C, N, H]
      b = cross_mask.shape[0]
      q = q.reshape(b, -1, *q.shape[2:])  # [B, K*C, N, H]: a source's rows as query positions
      out = self.cross_attention.attend_heads(q, cross["k"], cross["v"], cross_mask)
      return out.reshape(z.shape)  # [B, K*C, D] -> [B*K, C, D]

    y = self.self_attention_sublayer(y, self_attend, True)
    y = self._cross_and_ffn(y, cross_attend, True)
    return y, new


class UnrolledEncoder(nn.Module):
  """The encoder blocks one after another; their parameters (encoder_0, encoder_1, ...) sit
  in the Transformer's own scope."""
  cfg: TransformerConfig

  def setup(self):
    self.blocks = [EncoderBlock(self.cfg, name=f"encoder_{i}")
                   for i in range(self.cfg.num_encoder_layers)]

  def __call__(self, x, mask, deterministic: bool):
    for block in self.blocks:
      x = block(x, mask, deterministic)
    return x


class UnrolledDecoder(nn.Module):
  """The decoder blocks one after another (parameters decoder_0, ... in the Transformer's
  scope). Decoding caches are tuples of one array per layer (a layer's slice of a stacked
  array would be copied at every step)."""
  cfg: TransformerConfig

  def setup(self):
    self.blocks = [DecoderBlock(self.cfg, name=f"decoder_{i}")
                   for i in range(self.cfg.num_decoder_layers)]

  def __call__(self, y, memory, self_mask, cross_mask, deterministic: bool):
    for block in self.blocks:
      y = block(y, memory, self_mask, cross_mask, deterministic)
    return y

  def cross_kv(self, memory):
    """memory [B, S, D] -> every layer's cross-attention keys and values: two tuples of
    [B, N, S, H], one array per layer."""
    keys, values = zip(*(block.cross_kv(memory) for block in self.blocks))
    return keys, values

  def step(self, y, cache, cross, index, cross_mask):
    """y [B*K, C, D] through every layer, each writing its positions into its own cache."""
    keys, values = [], []
    for i, block in enumerate(self.blocks):
      layer_cross = cross and {"k": cross["k"][i], "v": cross["v"][i]}
      y, new = block.step(y, {"k": cache["k"][i], "v": cache["v"][i]}, layer_cross, index,
                          cross_mask)
      keys.append(new["k"])
      values.append(new["v"])
    return y, {"k": tuple(keys), "v": tuple(values)}


class _EncoderLayer(nn.Module):
  """One encoder block as an nn.scan body."""
  cfg: TransformerConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, mask):
    return EncoderBlock(self.cfg, name="block")(x, mask, self.deterministic), None


class _DecoderLayer(nn.Module):
  """One decoder block as an nn.scan body, in one of three modes sharing its parameters:
  `train` (teacher forcing), `cross_kv` (per-layer cross-attention keys/values) and `step`
  (one cached decoding position)."""
  cfg: TransformerConfig
  mode: str
  deterministic: bool = True

  @nn.compact
  def __call__(self, carry, *args):
    block = DecoderBlock(self.cfg, name="block")
    if self.mode == "train":
      return block(carry, *args, self.deterministic), None
    if self.mode == "cross_kv":
      return carry, block.cross_kv(carry)
    return block.step(carry, *args)


def _scan(layer_cls, cfg: TransformerConfig, length: int, in_axes, out_axes=0):
  if cfg.remat != "none":
    layer_cls = nn.remat(layer_cls, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
  return nn.scan(layer_cls, variable_axes={"params": 0},
                 split_rngs={"params": True, "dropout": True}, in_axes=in_axes,
                 out_axes=out_axes, length=length,
                 metadata_params={nn.PARTITION_NAME: "layers"})


class ScannedEncoder(nn.Module):
  """The encoder blocks as one nn.scan: parameters stacked on a leading `layers` axis."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, mask, deterministic: bool):
    stack = _scan(_EncoderLayer, self.cfg, self.cfg.num_encoder_layers, nn.broadcast)
    return stack(self.cfg, deterministic, name="layers")(x, mask)[0]


class ScannedDecoder(nn.Module):
  """The decoder blocks as one nn.scan. Caches hold a layer axis after the batch axis,
  [B, layers, ...], so that decoding reorders them by batch row like any other cache."""
  cfg: TransformerConfig

  @nn.compact
  def run(self, mode: str, carry, *args, deterministic: bool = True):
    """The scan in one of its modes (they share the stacked parameters)."""
    in_axes = {"train": nn.broadcast, "cross_kv": (),
               "step": (1, 1, nn.broadcast, nn.broadcast)}[mode]
    stack = _scan(_DecoderLayer, self.cfg, self.cfg.num_decoder_layers, in_axes, out_axes=1)
    return stack(self.cfg, mode, deterministic, name="layers")(carry, *args)

  def __call__(self, y, memory, self_mask, cross_mask, deterministic: bool):
    return self.run("train", y, memory, self_mask, cross_mask, deterministic=deterministic)[0]

  def cross_kv(self, memory):
    """memory [B, S, D] -> every layer's cross-attention keys and values [B, layers, N, S, H]."""
    return self.run("cross_kv", memory)[1]

  def step(self, y, cache, cross, index, cross_mask):
    return self.run("step", y, cache, cross, index, cross_mask)
