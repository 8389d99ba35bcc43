"""Our train step against the same Transformer in PyTorch, timed A B A B in one process.

  pip install ".[bench]"   # torch (the CPU build: see the README's test command)
  python benchmarks/compare_pytorch.py --config configs/fra_eng.py [--rows 48 --len 48]
      [--rounds 4 --steps 5] [--compile] [--set model.d_model=512 ...] [--json out.json]

PyTorch side: `torch.nn.Transformer` (post-LN, ReLU, batch_first), embeddings shared between
source and target and tied to the output projection, sinusoidal positions, label-smoothed
cross-entropy ignoring padding, Adam(0.9, 0.98, 1e-9) and global-norm clipping: the same
architecture, sizes, batch and lengths as ours. Both sides run full rows of random tokens.
With --compile a third entry, the same PyTorch model and loss under `torch.compile` (inductor,
default mode), joins the round-robin: ours, eager PyTorch and compiled PyTorch A B C A B C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchmarks.common import interleaved, load_config  # noqa: E402
from benchmarks.train_step import synthetic_batch, train_setup  # noqa: E402
from transformer_jax import sharding  # noqa: E402
from transformer_jax.models import build


def torch_step_fn(config, vocab: int, batch, compile_model: bool = False):
  import torch
  from torch import nn
  # The same kind of device as ours: CUDA when JAX runs on a GPU, else the CPU's every core.
  dev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  if dev == "cpu":
    torch.set_num_threads(os.cpu_count())
  m = config.model
  d = m.d_model

  class TorchTransformer(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(vocab, d, padding_idx=0)
      self.core = nn.Transformer(d, m.num_heads, m.num_encoder_layers, m.num_decoder_layers,
                                 m.ffn_dim, m.dropout_rate, batch_first=True, norm_first=False)
      pos = torch.arange(config.data.max_len)[:, None]
      inv = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
      pe = torch.zeros(config.data.max_len, d)
      pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
      self.register_buffer("pe", pe)
      self.drop = nn.Dropout(m.dropout_rate)

    def forward(self, src, tgt):
      x = self.drop(self.embed(src) * math.sqrt(d) + self.pe[:src.shape[1]])
      y = self.drop(self.embed(tgt) * math.sqrt(d) + self.pe[:tgt.shape[1]])
      causal = self.core.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
      h = self.core(x, y, tgt_mask=causal, src_key_padding_mask=src == 0,
                    tgt_key_padding_mask=tgt == 0, memory_key_padding_mask=src == 0)
      return h @ self.embed.weight.T  # Tied output projection.

  model = TorchTransformer().to(dev)
  opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  cross_entropy = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=config.step.label_smoothing)
  # Ours in bfloat16 computes in bf16 with float32 parameters and a float32 loss: autocast.
  bf16 = m.dtype == "bfloat16"

  def forward_loss(src, tgt_in, tgt):
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
      logits = model(src, tgt_in)
    return cross_entropy(logits.float().reshape(-1, vocab), tgt.reshape(-1))

  if compile_model:  # Forward and loss in one graph; backward compiled by AOTAutograd.
    forward_loss = torch.compile(forward_loss)
  src, tgt_in, tgt = (torch.from_numpy(batch[k]).long().to(dev)
                      for k in ("inputs", "decoder_inputs", "targets"))

  def step():
    opt.zero_grad(set_to_none=True)
    loss = forward_loss(src, tgt_in, tgt)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
    opt.step()
    return loss.item()
  name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
  return step, f"{torch.__version__} on {name}"


def jax_step_fn(config, batch):
  _, mesh, state, p_train = train_setup(config, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
  holder = {"state": state}
  with sharding.mesh_context(mesh):
    gbatch = sharding.global_batch(batch, mesh)

  def step():
    with sharding.mesh_context(mesh):
      holder["state"], metrics = p_train(holder["state"], gbatch)
    return float(metrics["loss"])  # Waits for the step.
  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/fra_eng.py")
  parser.add_argument("--rows", type=int, default=0)
  parser.add_argument("--len", type=int, default=0)
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="config override, e.g. --set model.d_model=512")
  parser.add_argument("--compile", action="store_true",
                      help="also time the PyTorch model under torch.compile")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  config = load_config(args.config, args.set)
  config.data.max_len = args.len or config.data.max_len
  rows = args.rows or config.data.batch_size
  vocab = build.padded_vocab(config.data.vocab_size)
  batch = synthetic_batch(rows, config.data.max_len, vocab)

  steps = {"jax": jax_step_fn(config, batch)}
  steps["torch"], torch_version = torch_step_fn(config, vocab, batch)
  if args.compile:
    steps["torch.compile"], _ = torch_step_fn(config, vocab, batch, compile_model=True)
  times = interleaved(steps, args.rounds, calls=args.steps)
  median = {name: statistics.median(t) for name, t in times.items()}
  tokens = rows * config.data.max_len
  print(f"device: {jax.devices()[0].device_kind} ({os.cpu_count()} cores), jax {jax.__version__},"
        f" torch {torch_version}; {config.model.dtype}, d_model {config.model.d_model}, "
        f"{config.model.num_encoder_layers}+{config.model.num_decoder_layers} layers, "
        f"FFN {config.model.ffn_dim}, {config.model.num_heads} heads, vocab {vocab}, "
        f"batch {rows} x {config.data.max_len} tokens a side")
  for name in steps:
    print(f"{name:>13}: median step {median[name] * 1e3:8.1f} ms "
          f"(min {min(times[name]) * 1e3:.1f}, max {max(times[name]) * 1e3:.1f}), "
          f"{tokens / median[name]:8.0f} target tokens/s")
  ratios = {name: median[name] / median["jax"] for name in steps if name != "jax"}
  for name, ratio in ratios.items():
    print(f"ours / {name} throughput: {ratio:.2f}x")
  if args.json:
    Path(args.json).write_text(json.dumps({"median_s": median, "times_s": times,
                                           "ratio": ratios["torch"], "ratios": ratios,
                                           "torch": torch_version}, indent=2))


if __name__ == "__main__":
  main()
