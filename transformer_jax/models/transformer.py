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

Einsum legend: B batch, T target length, S source length, N heads, H head dim, D model dim,
F FFN dim, V vocabulary.

The parts live beside this file: common.py (the config, positions, the tied projection),
attention.py, blocks.py (the blocks and their stacks).
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import sharding
from transformer_jax.models import embedding, int8
from transformer_jax.models.attention import SegmentMask
from transformer_jax.models.blocks import (ScannedDecoder, ScannedEncoder, UnrolledDecoder,
                                           UnrolledEncoder, activation)
from transformer_jax.models.common import (TransformerConfig, sinusoidal_positions, tied_logits,
                                           xavier_init)


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

  def scale(self) -> jax.Array | None:
    """The table's per-row scales [V] when its values are int8 (models/int8.py), else None."""
    return int8.scale_of(self, "embedding")

  def __call__(self, tokens):
    """tokens: [B, L] int -> [B, L, D] in the compute dtype."""
    scale = self.scale()
    if scale is not None:  # int8 rows, each times its scale.
      rows = jnp.take(self.embedding, tokens, axis=0).astype(jnp.float32)
      return (rows * jnp.take(scale, tokens, axis=0)[..., None]).astype(self.cfg.compute_dtype)
    return embedding.lookup(self.embedding, tokens, self.cfg.compute_dtype, self.cfg.embed_grad,
                            sharding.data_parallel_size())


def _final_norm(cfg: TransformerConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=cfg.layer_norm_eps, dtype=cfg.compute_dtype, name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


def _output_projection(cfg: TransformerConfig) -> nn.Dense:
  return nn.Dense(cfg.tgt_vocab_size, dtype=cfg.compute_dtype,
                  kernel_init=xavier_init(("embed", "vocab")),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)))


class _Shared:
  """What the four models share: the embedded inputs, the vocabulary projection (through the
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
    scale = self._output_embed().scale()
    if scale is not None:  # An int8 table (decoding: models/int8.py).
      return int8.matmul(y, self._output_table(), scale, contract=1).astype(dt)
    return tied_logits(y.astype(dt), self._output_table().astype(dt))

  def _output_table(self):
    return self._output_embed().embedding

  def _logits_of(self, y, ids):
    """[B, T, D] -> [B, T, C]: `_logits`' columns of the vocabulary ids `ids` [C] alone."""
    dt = self.cfg.compute_dtype
    if not self.cfg.tie_output:
      kernel, bias = self.output_weights()
      return y.astype(dt) @ jnp.take(kernel, ids, axis=1) + jnp.take(bias, ids)
    rows = jnp.take(self._output_table(), ids, axis=0)  # [C, D]
    scale = self._output_embed().scale()
    if scale is not None:
      return int8.matmul(y, rows, jnp.take(scale, ids), contract=1).astype(dt)
    return tied_logits(y.astype(dt), rows.astype(dt))

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

  def _output_embed(self):
    return self.tgt_embed

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

  def decode_step(self, tokens, cache, source, ids=None):
    """tokens: [B*K, 1], the previous outputs (or <bos>) of K rows per source (beams; K = 1 for
    greedy) -> (logits [B*K, V] float32, cache). `source`: `source_state`'s, of the B sources.
    cache["index"]: the position decoded, one for all rows ([]) or one a row ([B*K]: decoding
    slots, each row at its own step). `ids` [C]: the logits of those vocabulary ids only,
    [B*K, C] (a shortlist)."""
    index = cache["index"]
    positions = jnp.broadcast_to(jnp.reshape(index, (-1, 1)), tokens.shape)
    y = self._inputs(self.tgt_embed, tokens, positions, True)
    cross_mask = source["valid"][:, None, None, :]  # [B, 1, 1, S]
    layers = {"k": cache["k"], "v": cache["v"]}
    cross = {"k": source["k"], "v": source["v"]}
    y, layers = self.decoder_stack.step(y, layers, cross, index, cross_mask)
    if self.cfg.pre_ln:
      y = self.decoder_norm(y)
    logits = self._logits(y) if ids is None else self._logits_of(y, ids)
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

  def _output_embed(self):
    return self.embed

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
    next one, cache). `source` is unused (no cross-attention): the encoder-decoder model's
    signature, which the decoders of decoding/generation.py and prompts.py call alike."""
    logits, cache = self.extend(tokens, cache)
    return logits[:, 0], cache

  def extend(self, tokens, cache, last=None):
    """Reads C positions in one pass (a prompt, or a chunk of one): tokens [B, C], each row's
    tokens from cache["index"] (scalar, or [B]: each row's own) on -> (logits float32 for the
    next tokens, cache with their keys and values and index + C). The logits are [B, C, V],
    or with `last` [B] only those of each row's chunk position last[b], [B, V] (the vocabulary
    projection computed for those alone)."""
    y, cache = self.cached_features(tokens, cache)
    if last is not None:
      y = jnp.take_along_axis(y, jnp.reshape(last, (-1, 1, 1)), axis=1)  # [B, 1, D]
    logits = self.project(y)
    return (logits if last is None else logits[:, 0]), cache

  def cached_features(self, tokens, cache):
    """`extend`'s features before the vocabulary projection (`project`): [B, C, D]. Positions
    past a row's prompt compute what the caller ignores: their keys and values lie after the
    prompt's, where the next steps write before they read."""
    index = cache["index"]
    width = tokens.shape[1]
    positions = jnp.reshape(index, (-1, 1)) + jnp.arange(width)
    # Past the learned table: a position no caller reads (its cache write is dropped).
    positions = jnp.broadcast_to(jnp.minimum(positions, self.cfg.max_len - 1), tokens.shape)
    y = self._inputs(self.embed, tokens, positions, True)
    y, layers = self.decoder_stack.step(y, {"k": cache["k"], "v": cache["v"]}, None, index, None)
    if self.cfg.pre_ln:
      y = self.decoder_norm(y)
    return y, {"index": index + width, **layers}


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
                              kernel_init=xavier_init(("embed", "mlp")),
                              bias_init=nn.with_logical_partitioning(nn.initializers.zeros,
                                                                     ("mlp",)))
    self.mlm_norm = _final_norm(cfg, "mlm_norm")
    if cfg.tie_output:
      self.mlm_bias = self.param("mlm_bias", nn.with_logical_partitioning(
          nn.initializers.zeros, ("vocab",)), (cfg.tgt_vocab_size,))
    else:
      self.output_proj = _output_projection(cfg)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def _output_embed(self):
    return self.embed

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
                           kernel_init=xavier_init(("embed", "mlp")),
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
