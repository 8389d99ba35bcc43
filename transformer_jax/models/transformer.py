"""The encoder-decoder Transformer of "Attention Is All You Need", and the decoder-only and
encoder-only language models on the same blocks, as pure linen modules.

The structure follows the d2l.ai chapter: token embeddings scaled by sqrt(d_model) plus fixed
sinusoidal positions, encoder blocks (self-attention, Add&Norm, FFN, Add&Norm), decoder blocks
(causal self-attention, Add&Norm, cross-attention, Add&Norm, FFN, Add&Norm) and a projection to
the target vocabulary. The language model (`LanguageModel`, model.family="decoder_only") is the
decoder without cross-attention: causal self-attention and FFN blocks, next-token logits. The
masked language model (`MaskedLanguageModel`, model.family="encoder_only", BERT's shape) is the
encoder: bidirectional self-attention, then a transform (dense, activation, LayerNorm) and the
tied vocabulary projection with its own bias; fine-tuned to classify (`SequenceClassifier`), the
same encoder with a head on its first position.

Masks come from segment ids: 0 marks padding, and tokens attend only within their own segment.
An unpacked batch has segment id 1 on every real token, which is d2l's valid-length mask; a
packed batch has 1, 2, 3, ... for the sentences sharing a row.

Einsum legend: B batch, T target length, S source length, N heads, H head dim, D model dim,
F FFN dim, V vocabulary.

Logical axis names (mapped to mesh axes only in sharding.py):
  batch, length      activations' leading axes
  act_embed          the model dimension of activations
  embed              the model dimension of parameters
  heads, kv          attention heads and head dim
  mlp                FFN hidden dimension
  vocab              vocabulary
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from transformer_jax import sharding
from transformer_jax.models import embedding, splash
from transformer_jax.config import ModelConfig

REMAT_POLICIES = {"none": None, "full": None,
                  "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims}


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig(ModelConfig):
  """Frozen model hyperparameters: the config's model section (its defaults and checks) and the
  vocabularies; variants come from `dataclasses.replace`."""

  src_vocab_size: int
  tgt_vocab_size: int  # A language model's vocabulary.
  max_len: int = 0  # Rows of the learned position table (positions="learned").
  num_labels: int = 0  # An encoder-only classifier's labels (0: a masked language model).
  attention_weights: bool = False  # Sow attention weights into "intermediates".
  # Run Pallas kernels (splash attention) in the interpreter: programs for a CPU (tests).
  interpret_kernels: bool = False

  def check(self):
    super().check()
    if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
      raise ValueError("model.share_embeddings needs equal source and target vocabularies")
    if self.attention_weights and self.scan_layers:
      raise ValueError("attention weights are sown per layer: use an unscanned model")
    if self.positions == "learned" and self.max_len <= 0:
      raise ValueError("learned positions need the model's max_len")

  @property
  def cross_attention(self) -> bool:
    """Whether decoder blocks attend to a source (not in a decoder-only model)."""
    return self.family != "decoder_only"

  @property
  def by_lengths(self) -> bool:
    """Whether the attentions take rows' lengths and a causal flag instead of a dense mask."""
    return self.attention_mask == "lengths"

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


def _init(names, scale=1.0):
  """Xavier-uniform kernel init that carries logical axis names."""
  return nn.with_logical_partitioning(nn.initializers.variance_scaling(
      scale, "fan_avg", "uniform"), names)


def sinusoidal_positions(positions: jax.Array, d_model: int) -> jax.Array:
  """Fixed encoding of d2l's PositionalEncoding: sin on even, cos on odd features.

  Args:
    positions: [B, L] integer positions (restarting at 0 in every packed segment).
  Returns:
    [B, L, D] float32.
  """
  inv_freq = 1.0 / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float32) / d_model)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, D/2]
  # Interleave: feature 2i is sin, feature 2i+1 is cos.
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(
      *positions.shape, d_model)


@jax.custom_vjp
def tied_logits(y: jax.Array, embedding: jax.Array) -> jax.Array:
  """y [..., D] -> logits [..., V] against the (tied) embedding table [V, D].

  The custom backward pass forms the table's gradient as (y^T g)^T: XLA then transposes the
  small [D, V] product instead of writing the [tokens, V] logits gradient transposed (on the
  CPU that transposed write took 12% of the default config's train step).
  """
  return jnp.einsum("...d,vd->...v", y, embedding)


def _tied_logits_fwd(y, embedding):
  return tied_logits(y, embedding), (y, embedding)


def _tied_logits_bwd(residuals, g):
  y, embedding = residuals
  d_embedding = jnp.einsum("nd,nv->dv", y.reshape(-1, y.shape[-1]),
                           g.reshape(-1, g.shape[-1]).astype(y.dtype)).T
  return jnp.einsum("...v,vd->...d", g, embedding).astype(y.dtype), d_embedding.astype(
      embedding.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


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
              self.param(f"{name}_kernel", _init(("embed", "heads", "kv")), (d, n, h)))
      if cfg.attention_bias:
        setattr(self, f"{name}_bias", self.param(f"{name}_bias", nn.with_logical_partitioning(
            nn.initializers.zeros, ("heads", "kv")), (n, h)))
    self.out_kernel = self.param("out_kernel", _init(("heads", "kv", "embed")), (n, h, d))
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
      y = jnp.einsum("bld,dnh->blnh", x.astype(dt), getattr(self, f"{name}_kernel").astype(dt))
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
    y = jnp.einsum("btk,kd->btd", out.reshape(b, t, n * h),
                   self.out_kernel.astype(dt).reshape(n * h, -1))
    if self.cfg.attention_bias:
      y = y + self.out_bias.astype(dt)
    return y

  def __call__(self, x_q, x_kv, mask: SegmentMask):
    """x_q: [B, T, D], x_kv: [B, S, D] -> [B, T, D]."""
    (q,), (k, v) = self.project(x_q, "query"), self.project(x_kv, "key", "value")
    return self.attend(q, k, v, mask)


def activation(cfg: TransformerConfig):
  """The FFN's nonlinearity: ReLU, GELU in its exact (erf) form as BERT has it, or GELU's tanh
  approximation as GPT-2 has it."""
  if cfg.activation == "relu":
    return nn.relu
  return functools.partial(nn.gelu, approximate=cfg.activation == "gelu_tanh")


class FeedForward(nn.Module):
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic: bool):
    cfg = self.cfg
    h = nn.Dense(cfg.ffn_dim, dtype=cfg.compute_dtype, kernel_init=_init(("embed", "mlp")),
                 bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
                 name="wi")(x)  # [B, L, F]
    h = nn.with_logical_constraint(activation(cfg)(h), ("batch", "length", "mlp"))
    return nn.Dense(cfg.d_model, dtype=cfg.compute_dtype, kernel_init=_init(("mlp", "embed")),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                    name="wo")(h)  # [B, L, D]


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
    """One decoding position: y [B*K, 1, D] (K rows per source: beams) -> ([B*K, 1, D], cache
    with this position's k, v).

    cache: {"k", "v": [B*K, N, L, H]} this block's self-attention keys/values of the positions
    so far; cross: {"k", "v": [B, N, S, H]} its cross-attention keys/values, one per source (the
    K rows of a source attend to them as K query positions: nothing is tiled or reordered);
    cross_mask: [B, 1, 1, S] (cross and cross_mask None without cross-attention). Keys and
    values lie head-major, as the attention contracts them (`attend_heads`).
    """
    new = dict(cache)

    def self_attend(z):  # z: [B*K, 1, D]
      q, k, v = self.self_attention.project(z, "query", "key", "value")  # [B*K, 1, N, H] each
      positions = jnp.arange(cache["k"].shape[2])
      for name, kv in (("k", k), ("v", v)):  # Write this position into the preallocated cache.
        kv = jnp.swapaxes(kv, 1, 2).astype(cache[name].dtype)  # [B*K, N, 1, H]
        if index.ndim == 0:  # One position for every row.
          new[name] = lax.dynamic_update_slice(cache[name], kv, (0, 0, index, 0))
        else:  # Each row its own (decoding slots): [B*K] positions.
          rows = jnp.arange(kv.shape[0])
          new[name] = cache[name].at[rows, :, index].set(kv[:, :, 0], mode="promise_in_bounds")
      filled = positions[None, :] <= jnp.reshape(index, (-1, 1))  # [1 or B*K, L]
      return self.self_attention.attend_heads(q, new["k"], new["v"], filled[:, None, None, :])

    def cross_attend(z):  # z: [B*K, 1, D]
      (q,) = self.cross_attention.project(z, "query")  # [B*K, 1, N, H]
      b = cross_mask.shape[0]
      q = q.reshape(b, -1, *q.shape[2:])  # [B, K, N, H]: a source's K rows as query positions
      out = self.cross_attention.attend_heads(q, cross["k"], cross["v"], cross_mask)
      return out.reshape(z.shape)  # [B, K, D] -> [B*K, 1, D]

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
    """y [B*K, 1, D] through every layer, each writing its position into its own cache."""
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


class Embed(nn.Module):
  """A token embedding table [V, D] ("embedding", as nn.Embed names it) and its lookup, the
  table's gradient formed as `cfg.embed_grad` says (transformer_jax/models/embedding.py)."""
  cfg: TransformerConfig
  vocab_size: int

  def setup(self):
    # N(0, 1/D) entries, scaled by sqrt(D) on input: unit-variance inputs and, when tied,
    # unit-scale logits.
    self.embedding = self.param("embedding", nn.with_logical_partitioning(
        nn.initializers.normal(self.cfg.d_model ** -0.5), ("vocab", "embed")),
                                (self.vocab_size, self.cfg.d_model))

  def __call__(self, tokens):
    """tokens: [B, L] int -> [B, L, D] in the compute dtype."""
    return embedding.lookup(self.embedding, tokens, self.cfg.compute_dtype, self.cfg.embed_grad,
                            sharding.data_parallel_size())


def _final_norm(cfg: TransformerConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=cfg.layer_norm_eps, dtype=cfg.compute_dtype, name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


def _output_projection(cfg: TransformerConfig) -> nn.Dense:
  return nn.Dense(cfg.tgt_vocab_size, dtype=cfg.compute_dtype,
                  kernel_init=_init(("embed", "vocab")),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)))


class _Shared:
  """What both families share: the embedded inputs, the vocabulary projection (through the
  tied table, `_output_table()`, or `output_proj`) and the preallocated decoding cache."""

  def _setup_tokens(self):
    """A language model's one token table (`embed`) and, with learned positions, its
    `position_embedding` [max_len, D]."""
    cfg = self.cfg
    self.embed = Embed(cfg, cfg.tgt_vocab_size)
    if cfg.positions == "learned":
      self.position_embedding = self.param(
          "position_embedding", nn.with_logical_partitioning(
              nn.initializers.normal(cfg.d_model ** -0.5), (None, "embed")),
          (cfg.max_len, cfg.d_model))

  def _setup_encoder(self):
    """An encoder-only model's token table, positions and encoder stack (with its final norm,
    pre-LN): the parameters the masked language model and the classifier share."""
    cfg = self.cfg
    self._setup_tokens()
    if cfg.scan_layers:
      self.encoder_stack = ScannedEncoder(cfg)
    else:
      self.encoder_stack = UnrolledEncoder(cfg)
      nn.share_scope(self, self.encoder_stack)  # Parameters encoder_0, encoder_1, ...
    if cfg.pre_ln:
      self.encoder_norm = _final_norm(cfg, "encoder_norm")
    if cfg.embed_norm:
      self.embed_norm = _final_norm(cfg, "embed_norm")

  def _inputs(self, embed, tokens, positions, deterministic):
    """[B, L] tokens -> [B, L, D]: embedding * sqrt(D) + positions (sinusoidal, or the learned
    `position_embedding`), a LayerNorm where `embed_norm` (BERT's), then dropout."""
    # A Python float is weakly typed: x stays in the compute dtype (a NumPy float64 scalar
    # would promote bfloat16 to float32, and a scanned stack's carry must keep one dtype).
    x = embed(tokens) * float(np.sqrt(self.cfg.d_model))
    if self.cfg.positions == "learned":
      x = x + jnp.take(self.position_embedding, positions, axis=0).astype(x.dtype)
    else:
      x = x + sinusoidal_positions(positions, self.cfg.d_model).astype(x.dtype)
    if self.cfg.embed_norm:
      x = self.embed_norm(x)
    x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
    return self.dropout(x, deterministic=deterministic)

  def _encode(self, embed, tokens, segments, positions, deterministic):
    """tokens [B, L] through `embed`, the encoder stack (bidirectional within a segment) and,
    pre-LN, its final norm -> [B, L, D]."""
    segments, positions = _default_segments(tokens, segments, positions)
    mask = SegmentMask(segments, segments, by_lengths=self.cfg.by_lengths)
    x = self._inputs(embed, tokens, positions, deterministic)
    x = self.encoder_stack(x, mask, deterministic)
    return self.encoder_norm(x) if self.cfg.pre_ln else x

  def _logits(self, y):
    """[B, T, D] -> [B, T, V] through the tied embedding or the output projection."""
    if not self.cfg.tie_output:
      return self.output_proj(y)
    dt = self.cfg.compute_dtype
    return tied_logits(y.astype(dt), self._output_table().astype(dt))

  def output_weights(self):
    """(kernel [D, V], bias [V] or None) of the vocabulary projection in the compute dtype:
    the tied embedding transposed, or the output layer's parameters."""
    dt = self.cfg.compute_dtype
    if self.cfg.tie_output:
      return self._output_table().astype(dt).T, None
    params = self.output_proj.variables["params"]
    return params["kernel"].astype(dt), params["bias"].astype(dt)

  def logits(self, y):
    """Decoder features [B, T, D] -> logits [B, T, V] in the compute dtype (what the loss
    reads: it upcasts them itself and keeps no float32 copy for the backward pass)."""
    return nn.with_logical_constraint(self._logits(y), ("batch", "length", "vocab"))

  def project(self, y):
    """Decoder features [B, T, D] -> logits [B, T, V] (float32)."""
    return self.logits(y).astype(jnp.float32)

  def init_cache(self, rows: int, max_len: int):
    """The decoding state of `rows` output rows for `max_len` steps: the index and preallocated
    self-attention keys and values "k", "v", head-major as DecoderBlock.step reads them:
    [rows, layers, N, max_len, H] for a scanned stack, else tuples of one [rows, N, max_len, H]
    per layer."""
    cfg = self.cfg
    n, h, layers = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.num_decoder_layers
    if cfg.scan_layers:
      zeros = jnp.zeros((rows, layers, n, max_len, h), cfg.compute_dtype)
    else:
      zeros = (jnp.zeros((rows, n, max_len, h), cfg.compute_dtype),) * layers
    return {"index": jnp.zeros((), jnp.int32), "k": zeros, "v": zeros}


class Transformer(_Shared, nn.Module):
  """Encoder-decoder. Call with source tokens and shifted-right target tokens."""
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self.src_embed = Embed(cfg, cfg.src_vocab_size, name="src_embed")
    self.tgt_embed = (self.src_embed if cfg.share_embeddings
                      else Embed(cfg, cfg.tgt_vocab_size, name="tgt_embed"))
    # One interface, two stacks: (x, mask) -> x; (y, memory, masks) -> y; cross_kv; step.
    if cfg.scan_layers:
      self.encoder_stack, self.decoder_stack = ScannedEncoder(cfg), ScannedDecoder(cfg)
    else:
      self.encoder_stack, self.decoder_stack = UnrolledEncoder(cfg), UnrolledDecoder(cfg)
      nn.share_scope(self, self.encoder_stack)  # Parameters encoder_0, ..., as before.
      nn.share_scope(self, self.decoder_stack)
    if cfg.pre_ln:  # Pre-LN stacks end with a norm; post-LN blocks already end normalized.
      self.encoder_norm = _final_norm(cfg, "encoder_norm")
      self.decoder_norm = _final_norm(cfg, "decoder_norm")
    if not cfg.tie_output:
      self.output_proj = _output_projection(cfg)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def _output_table(self):
    return self.tgt_embed.embedding

  def encode(self, src, src_segments=None, src_positions=None, deterministic=True):
    """src: [B, S] int tokens (0 = padding) -> memory [B, S, D]."""
    return self._encode(self.src_embed, src, src_segments, src_positions, deterministic)

  def decode(self, memory, tgt_in, src_segments, tgt_segments=None, tgt_positions=None,
             deterministic=True):
    """memory: [B, S, D], tgt_in: [B, T] -> logits [B, T, V] (float32)."""
    return self.project(self.decode_features(memory, tgt_in, src_segments, tgt_segments,
                                             tgt_positions, deterministic))

  def decode_features(self, memory, tgt_in, src_segments, tgt_segments=None,
                      tgt_positions=None, deterministic=True):
    """decode() up to the vocabulary projection: [B, T, D] in the compute dtype."""
    tgt_segments, tgt_positions = _default_segments(tgt_in, tgt_segments, tgt_positions)
    self_mask = SegmentMask(tgt_segments, tgt_segments, causal=True,
                            by_lengths=self.cfg.by_lengths)  # [B, 1, T, T] where made dense
    cross_mask = SegmentMask(tgt_segments, src_segments, by_lengths=self.cfg.by_lengths)
    y = self._inputs(self.tgt_embed, tgt_in, tgt_positions, deterministic)
    y = self.decoder_stack(y, memory, self_mask, cross_mask, deterministic)
    return self.decoder_norm(y) if self.cfg.pre_ln else y

  def source_state(self, memory, src_segments):
    """What decoding keeps of a source, computed once and never reordered: the cross-attention
    keys and values of every layer and the source mask.

    memory: [B, S, D], src_segments: [B, S] (0 = padding) -> {"k", "v", "valid": [B, S] bool},
    keys and values head-major: [B, layers, N, S, H] for a scanned stack, else tuples of one
    [B, N, S, H] per layer.
    """
    cross_k, cross_v = self.decoder_stack.cross_kv(memory)
    return {"k": cross_k, "v": cross_v, "valid": src_segments > 0}

  def decode_step(self, tokens, cache, source):
    """tokens: [B*K, 1], the previous outputs (or <bos>) of K rows per source (beams; K = 1 for
    greedy) -> (logits [B*K, V] float32, cache). `source`: `source_state`'s, of the B sources.
    cache["index"]: the position decoded, one for all rows ([]) or one a row ([B*K]: decoding
    slots, each row at its own step)."""
    index = cache["index"]
    positions = jnp.broadcast_to(jnp.reshape(index, (-1, 1)), tokens.shape)
    y = self._inputs(self.tgt_embed, tokens, positions, True)
    cross_mask = source["valid"][:, None, None, :]  # [B, 1, 1, S]
    layers = {"k": cache["k"], "v": cache["v"]}
    cross = {"k": source["k"], "v": source["v"]}
    y, layers = self.decoder_stack.step(y, layers, cross, index, cross_mask)
    if self.cfg.pre_ln:
      y = self.decoder_norm(y)
    logits = self._logits(y)
    return logits[:, 0].astype(jnp.float32), {"index": index + 1, **layers}

  def __call__(self, src, tgt_in, src_segments=None, tgt_segments=None, src_positions=None,
               tgt_positions=None, deterministic=True):
    """src: [B, S], tgt_in: [B, T] (targets shifted right, starting with <bos>) -> [B, T, V].

    Segment ids default to `tokens != 0` and positions to 0..L-1: the unpacked, padded case.
    """
    return self.project(self.features(src, tgt_in, src_segments, tgt_segments, src_positions,
                                      tgt_positions, deterministic))

  def features(self, src, tgt_in, src_segments=None, tgt_segments=None, src_positions=None,
               tgt_positions=None, deterministic=True):
    """__call__ up to the vocabulary projection: [B, T, D] decoder features (a loss can then
    project them slice by slice with `project`)."""
    src_segments, src_positions = _default_segments(src, src_segments, src_positions)
    memory = self.encode(src, src_segments, src_positions, deterministic)
    return self.decode_features(memory, tgt_in, src_segments, tgt_segments, tgt_positions,
                                deterministic)


class LanguageModel(_Shared, nn.Module):
  """Decoder-only (GPT-style): tokens [B, T] -> next-token logits [B, T, V]. Packed rows hold
  several documents (segment ids 1, 2, ...; positions restart at 0 in each), none attending to
  another."""
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self._setup_tokens()
    if cfg.scan_layers:
      self.decoder_stack = ScannedDecoder(cfg)
    else:
      self.decoder_stack = UnrolledDecoder(cfg)
      nn.share_scope(self, self.decoder_stack)  # Parameters decoder_0, decoder_1, ...
    if cfg.pre_ln:
      self.decoder_norm = _final_norm(cfg, "decoder_norm")
    if not cfg.tie_output:
      self.output_proj = _output_projection(cfg)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def _output_table(self):
    return self.embed.embedding

  def features(self, tokens, segments=None, positions=None, deterministic=True):
    """tokens: [B, T] int (0 = padding) -> [B, T, D] features before the vocabulary projection.
    Segment ids default to `tokens != 0` and positions to 0..T-1."""
    segments, positions = _default_segments(tokens, segments, positions)
    mask = SegmentMask(segments, segments, causal=True,
                       by_lengths=self.cfg.by_lengths)  # [B, 1, T, T] where made dense
    y = self._inputs(self.embed, tokens, positions, deterministic)
    y = self.decoder_stack(y, None, mask, None, deterministic)
    return self.decoder_norm(y) if self.cfg.pre_ln else y

  def __call__(self, tokens, segments=None, positions=None, deterministic=True):
    """tokens: [B, T] -> logits [B, T, V] (float32): position t predicts token t + 1."""
    return self.project(self.features(tokens, segments, positions, deterministic))

  def decode_step(self, tokens, cache, source=None):
    """tokens: [B, 1], each row's token at cache["index"] -> (logits [B, V] float32 for the
    next one, cache). `source` is unused (no cross-attention): decode.py's interface."""
    index = cache["index"]
    positions = jnp.broadcast_to(jnp.reshape(index, (-1, 1)), tokens.shape)
    y = self._inputs(self.embed, tokens, positions, True)
    y, layers = self.decoder_stack.step(y, {"k": cache["k"], "v": cache["v"]}, None, index, None)
    if self.cfg.pre_ln:
      y = self.decoder_norm(y)
    return self._logits(y)[:, 0].astype(jnp.float32), {"index": index + 1, **layers}


class MaskedLanguageModel(_Shared, nn.Module):
  """Encoder-only (BERT-style): tokens [B, T], some replaced by the mask id -> logits [B, T, V]
  predicting every position's original token. Attention is bidirectional within a segment:
  packed rows hold several documents' chunks (segment ids 1, 2, ...), none attending to
  another, and padding (segment 0) to nothing."""
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self._setup_encoder()
    # The masked-LM head: a transform of each position's features, then the vocabulary.
    self.mlm_dense = nn.Dense(cfg.d_model, dtype=cfg.compute_dtype,
                              kernel_init=_init(("embed", "mlp")),
                              bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                                     ("mlp",)))
    self.mlm_norm = _final_norm(cfg, "mlm_norm")
    if cfg.tie_output:
      self.mlm_bias = self.param("mlm_bias", nn.with_logical_partitioning(
          nn.initializers.zeros, ("vocab",)), (cfg.tgt_vocab_size,))
    else:
      self.output_proj = _output_projection(cfg)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def _output_table(self):
    return self.embed.embedding

  def encode(self, tokens, segments=None, positions=None, deterministic=True):
    """tokens: [B, T] int (0 = padding) -> the encoder's output [B, T, D]."""
    return self._encode(self.embed, tokens, segments, positions, deterministic)

  def features(self, tokens, segments=None, positions=None, deterministic=True):
    """[B, T] -> the masked-LM head's transformed features [B, T, D], before the vocabulary."""
    x = self.encode(tokens, segments, positions, deterministic)
    return self.mlm_norm(activation(self.cfg)(self.mlm_dense(x)))

  def _logits(self, y):
    if not self.cfg.tie_output:
      return self.output_proj(y)
    dt = self.cfg.compute_dtype
    return tied_logits(y.astype(dt), self._output_table().astype(dt)) + self.mlm_bias.astype(dt)

  def output_weights(self):
    if not self.cfg.tie_output:
      return super().output_weights()
    dt = self.cfg.compute_dtype
    return self._output_table().astype(dt).T, self.mlm_bias.astype(dt)

  def __call__(self, tokens, segments=None, positions=None, deterministic=True):
    """tokens: [B, T] -> logits [B, T, V] (float32) for the original token at every position."""
    return self.project(self.features(tokens, segments, positions, deterministic))


class SequenceClassifier(_Shared, nn.Module):
  """Encoder-only, fine-tuned to classify: tokens [B, T] (one text a row, its first token
  <bos>) -> logits [B, num_labels]. The encoder is the masked language model's (the same
  parameter names, so a pretrained one starts it: training/finetune.py); the head reads the
  first position's features, as BERT's: a dense layer and tanh (the pooler), dropout, then a
  dense layer to the labels."""
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    self._setup_encoder()
    self.pooler = nn.Dense(cfg.d_model, dtype=cfg.compute_dtype,
                           kernel_init=_init(("embed", "mlp")),
                           bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                                  ("mlp",)))
    # Small weights (BERT's 0.02): the labels start near equally likely.
    self.classifier = nn.Dense(cfg.num_labels, dtype=cfg.compute_dtype,
                               kernel_init=nn.with_logical_partitioning(
                                   nn.initializers.normal(0.02), ("mlp", None)),
                               bias_init=nn.initializers.zeros)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def __call__(self, tokens, segments=None, positions=None, deterministic=True):
    """tokens: [B, T] int (0 = padding) -> logits [B, num_labels] (float32)."""
    x = self._encode(self.embed, tokens, segments, positions, deterministic)  # [B, T, D]
    pooled = jnp.tanh(self.pooler(x[:, 0]))  # [B, D]: the first token's features.
    pooled = self.dropout(pooled, deterministic=deterministic)
    return self.classifier(pooled).astype(jnp.float32)


def _default_segments(tokens, segments, positions):
  if segments is None:
    segments = (tokens != 0).astype(jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return segments, positions
