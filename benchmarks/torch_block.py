"""The nanoGPT-style PyTorch block both PyTorch peers train (lm_vs_pytorch.py, gpt2_step.py):
pre-LN, one fused query/key/value projection, scaled_dot_product_attention, a ReLU FFN. It
imports torch (the bench extra): import it where a peer runs."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
  def __init__(self, d: int, heads: int, ffn_dim: int, eps: float, dropout: float = 0.0):
    super().__init__()
    self.heads, self.dropout = heads, dropout
    self.ln1, self.ln2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
    self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.ffn = nn.Sequential(nn.Linear(d, ffn_dim), nn.ReLU(), nn.Linear(ffn_dim, d))
    self.drop = nn.Dropout(dropout)

  def forward(self, x, mask=None):
    """x [B, T, D]; `mask` [B, 1, T, T] (True: attend), or None: causal, SDPA's `is_causal`
    (its flash kernel where the device has one)."""
    b, t, d = x.shape
    # [B, T, 3D] -> [3, B, N, T, H]
    q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
        2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       dropout_p=self.dropout if self.training else 0.0)
    x = x + self.drop(self.out(y.transpose(1, 2).reshape(b, t, d)))  # [B, N, T, H] -> [B, T, D]
    return x + self.drop(self.ffn(self.ln2(x)))
