"""The nanoGPT-style PyTorch block the PyTorch peers train (lm_vs_pytorch.py, gpt2_step.py,
compare_pytorch.py): pre-LN, one fused query/key/value projection, scaled_dot_product_attention,
a ReLU FFN; and the language model of a config's shape made of it. It imports torch (the bench
extra): import it where a peer runs."""

from __future__ import annotations

import math

import torch

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


class GPT(nn.Module):
  """A decoder-only config's language model: token and learned position embeddings (N(0, 1 /
  d_model), scaled by sqrt(d_model), as ours), its pre-LN blocks, a final LayerNorm and an
  output tied to the embedding. forward(tokens, segments, positions) -> logits; a token reads
  the earlier tokens of its own segment."""

  def __init__(self, cfg, vocab: int):
    super().__init__()
    m = cfg.model
    self.d = m.d_model
    self.tok, self.pos = nn.Embedding(vocab, m.d_model), nn.Embedding(cfg.data.max_len, m.d_model)
    for table in (self.tok, self.pos):
      nn.init.normal_(table.weight, std=m.d_model ** -0.5)
    self.blocks = nn.ModuleList(Block(m.d_model, m.num_heads, m.ffn_dim, m.layer_norm_eps,
                                      m.dropout_rate) for _ in range(m.num_decoder_layers))
    self.ln = nn.LayerNorm(m.d_model, eps=m.layer_norm_eps)
    self.drop = nn.Dropout(m.dropout_rate)

  def forward(self, tokens, segments, positions):
    # [B, 1, T, T]: a token sees the earlier tokens of its own segment only.
    same = segments[:, None, :, None] == segments[:, None, None, :]
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool,
                        device=tokens.device).tril()
    mask = same & causal & (segments[:, None, None, :] > 0)
    mask = mask | torch.eye(tokens.shape[1], dtype=torch.bool, device=tokens.device)
    x = self.drop(self.tok(tokens) * math.sqrt(self.d) + self.pos(positions))
    for block in self.blocks:
      x = block(x, mask)
    return self.ln(x) @ self.tok.weight.T  # Tied output.


def adamw(model: nn.Module, o, fused: bool = False) -> torch.optim.AdamW:
  """AdamW as ours: the optimizer section's rate, betas and epsilon, weight decay on matrices
  only; `fused`: PyTorch's one-kernel update (CUDA's, and the CPU's since 2.4)."""
  decay = [p for p in model.parameters() if p.dim() > 1]
  rest = [p for p in model.parameters() if p.dim() <= 1]
  return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                            {"params": rest, "weight_decay": 0.0}], lr=o.learning_rate,
                           betas=(o.adam_b1, o.adam_b2), eps=o.adam_eps, fused=fused)
