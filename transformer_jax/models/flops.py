"""The model's FLOPs counted from its shapes (the analytic count that utilisation figures and
the ahead-of-time report compare with)."""

from __future__ import annotations

import numpy as np

from transformer_jax.models.common import TransformerConfig

# Dense bfloat16 peak FLOP/s of one device, by a part of jax's device_kind (vendor data sheets).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v4": 275e12,
             "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
             "TPU v6": 918e12}


def model_flops(cfg: TransformerConfig, src_lens: np.ndarray, tgt_lens: np.ndarray) -> float:
  """Training FLOPs (forward + backward = 3 x forward) of one batch.

  src_lens, tgt_lens: [B] lengths attended over (one sentence a row; for packed rows pass the
  per-sentence lengths of every sentence). A language model (decoder-only or encoder-only)
  reads only tgt_lens, its documents' lengths (a classifier's: its texts'). Multiply-adds count
  2 FLOPs.
  """
  d, f, v = cfg.d_model, cfg.ffn_dim, cfg.tgt_vocab_size
  s, t = src_lens.astype(np.float64), tgt_lens.astype(np.float64)
  encoder_only = cfg.family == "encoder_only"
  if encoder_only:  # The encoder reads the documents.
    s = t
  enc = cfg.num_encoder_layers * (
      (8 * d * d + 4 * d * f) * s.sum()  # Q, K, V, O projections and the FFN
      + 4 * d * (s * s).sum())  # scores and weighted values over all S keys
  dec = cfg.num_decoder_layers * (
      (8 * d * d + 4 * d * f) * t.sum()  # self-attention Q, K, V, O; FFN
      + 2 * d * (t * t).sum())  # causal self-attention: half the T x T scores
  if cfg.cross_attention:
    dec += cfg.num_decoder_layers * (
        4 * d * d * t.sum()  # cross-attention Q, O
        + 4 * d * d * s.sum()  # cross-attention K, V of the encoder output
        + 4 * d * (t * s).sum())  # cross-attention scores and values
  if cfg.num_labels:  # A classifier's head reads one position a text: pooler, labels.
    out = (2 * d * d + 2 * d * cfg.num_labels) * len(t)
  else:
    out = 2 * d * v * t.sum()  # vocabulary projection
  if encoder_only and not cfg.num_labels:
    out += 2 * d * d * t.sum()  # the masked-LM head's transform
  return 3.0 * (enc + dec + out)


def segment_lengths(segment_ids: np.ndarray) -> np.ndarray:
  """All sentences' lengths in a [B, L] batch of segment ids (0 = padding), row by row, in
  segment-id order; one bincount for the batch (training counts every batch it feeds)."""
  ids = np.asarray(segment_ids)
  per_row = int(ids.max(initial=0)) + 1
  keys = (np.arange(ids.shape[0])[:, None] * per_row + ids).ravel()  # [B*L] (row, id) keys
  counts = np.bincount(keys, minlength=ids.shape[0] * per_row).reshape(-1, per_row)[:, 1:]
  return counts[counts > 0]


def batch_flops(cfg: TransformerConfig, batch: dict[str, np.ndarray]) -> float:
  """model_flops of a (packed or padded) batch of segment ids (a language model's batch has
  only the target side)."""
  sources = (segment_lengths(batch["inputs_segment_ids"]) if "inputs_segment_ids" in batch
             else np.zeros(0))
  return model_flops(cfg, sources, segment_lengths(batch["targets_segment_ids"]))


def peak_flops(device_kind: str, given: float = 0.0) -> float | None:
  """`given` where positive; else the vendor's bf16 peak of a known device kind; else None."""
  if given > 0:
    return given
  return next((p for name, p in PEAK_BF16.items() if name in device_kind), None)
