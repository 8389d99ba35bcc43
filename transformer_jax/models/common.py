"""What every part of the models reads: the frozen model config, the initializer that carries
logical axis names, the sinusoidal positions and the tied vocabulary projection.

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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ModelConfig


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


def xavier_init(names, scale=1.0):
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
