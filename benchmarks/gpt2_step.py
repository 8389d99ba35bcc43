"""The language model's train step at GPT-2 small's shape against a nanoGPT-style PyTorch peer,
timed round-robin in one process: tokens/s and model-FLOPs utilisation of each.

  pip install ".[bench]"   # torch
  python benchmarks/gpt2_step.py [--config configs/lm_gpt2_small.py] [--rounds 5 --steps 10]
      [--variant model.remat=none --variant model.attention_mask=lengths,data.packing=False]
      [--peers compiled,eager | none] [--json OUT.json]

The shape is configs/lm_gpt2_small.py's: 12 pre-LN layers, d_model 768, 12 heads, FFN 3,072,
1,024 tokens, 64 rows, a 50,257-piece vocabulary padded to 50,304 (llm.c's and nanoGPT's), bf16
compute, AdamW; full rows of uniform random ids (one document a row), the same batches for
every entry. Ours is the library's own train step (`step_lib.jit_steps`); each `--variant`
(comma-separated FIELD=VALUE overrides) adds one more of ours.

The peer is written here with nanoGPT's own settings: one fused q/k/v projection,
`scaled_dot_product_attention(q, k, v, is_causal=True)` with no mask (the flash kernel), the
FFN and the output tied to the token embedding, `torch.optim.AdamW(fused=True)` with the
config's betas, epsilon and weight decay (matrices only) and global-norm clipping, bf16
autocast with the loss on the logits as autocast gives them (cross-entropy upcasts inside),
and `torch.compile(model)` (inductor, default mode) for `compiled`; `eager` is the same
without compile. The peer's FFN is ReLU, as ours (nanoGPT's is GELU): both compute the same
function and the same FLOPs.

Each entry runs `--steps` steps queued back to back, then waits, once a round for `--rounds`
rounds (A B C A B C); the median round gives its step time. Model FLOPs follow
transformer_jax/models/flops.py (causal attention counted as half the T x T scores); utilisation is
against the device's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the device.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import load_config  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from transformer_jax import config as config_lib, sharding  # noqa
from transformer_jax.models import build
from transformer_jax.models import flops
from transformer_jax.training import steps as step_lib


def lm_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Full rows of uniform random ids, one document a row (a language model's features)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, vocab, (rows, length + 1)).astype(np.int32)
  return {"decoder_inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "targets_segment_ids": np.ones((rows, length), np.int32),
          "targets_positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1))}


def ours(config, batch) -> tuple[callable, float]:
  """(run(k): k train steps queued then waited on, model FLOPs a step) of the library's step."""
  c = config_lib.parse(config)
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  cfg = build.model_config(c.model, c.data.vocab_size, c.data.vocab_size,
                              max_len=c.data.max_len)
  state, shardings = step_lib.create_train_state(
      build.build_model(cfg), step_lib.make_optimizer(c.optimizer, c.run.num_steps), 0,
      mesh, c.data.max_len)
  p_train, _ = step_lib.jit_steps(shardings, mesh, c.step)
  with sharding.mesh_context(mesh):
    device_batch = sharding.global_batch(batch, mesh)
    compiled = p_train.lower(state, device_batch).compile()
  held = {"state": state}

  def run(k: int):
    for _ in range(k):
      held["state"], metrics = compiled(held["state"], device_batch)
    jax.block_until_ready(metrics)

  return run, flops.batch_flops(cfg, batch)


def peer(config, batch, compiled: bool):
  """run(k) of the nanoGPT-style PyTorch step (see the module's docstring)."""
  import torch
  import torch.nn.functional as F
  from torch import nn
  from benchmarks.torch_block import Block, adamw
  dev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  c = config_lib.parse(config)
  m, o = c.model, c.optimizer
  d, heads, vocab = m.d_model, m.num_heads, build.padded_vocab(c.data.vocab_size)
  torch.manual_seed(0)

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(c.data.max_len, d)
      self.blocks = nn.ModuleList(Block(d, heads, m.ffn_dim, m.layer_norm_eps)
                                  for _ in range(m.num_decoder_layers))
      self.ln = nn.LayerNorm(d, eps=m.layer_norm_eps)

    def forward(self, tokens, targets):
      positions = torch.arange(tokens.shape[1], device=tokens.device)
      x = self.tok(tokens) * d ** 0.5 + self.pos(positions)
      for block in self.blocks:
        x = block(x)
      logits = self.ln(x) @ self.tok.weight.T  # [B, T, V], tied
      return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

  model = GPT().to(dev)
  opt = adamw(model, o, fused=dev == "cuda")
  forward = torch.compile(model) if compiled else model
  tokens, targets = (torch.from_numpy(batch[k]).long().to(dev)
                     for k in ("decoder_inputs", "targets"))

  def run(k: int):
    for _ in range(k):
      with torch.autocast(dev, dtype=torch.bfloat16, enabled=m.dtype == "bfloat16"):
        loss = forward(tokens, targets)
      opt.zero_grad(set_to_none=True)
      loss.backward()
      if o.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
      opt.step()
    loss.item()  # Waits for the queued steps.

  return run, torch.__version__, dev


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_gpt2_small.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="overrides for every entry")
  parser.add_argument("--variant", action="append", default=[],
                      help="one more of ours: comma-separated FIELD=VALUE overrides")
  parser.add_argument("--peers", default="compiled",
                      help="PyTorch peers, comma-separated: compiled, eager; none: ours only")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10, help="steps queued a round")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  peers = [p for p in args.peers.split(",") if p and p != "none"]
  unknown = sorted(set(peers) - {"compiled", "eager"})
  if unknown:
    sys.exit(f"error: --peers {args.peers!r}: choose from compiled, eager, none")
  if args.json:
    out = Path(args.json)
    if out.is_dir() or not out.parent.is_dir():
      sys.exit(f"error: --json {args.json}: not a file in an existing directory")
  specs = {"ours": args.set, **{f"ours [{v}]": args.set + [s for s in v.split(",") if s]
                                for v in args.variant}}
  configs = {}
  for name, overrides in specs.items():
    try:
      configs[name] = load_config(args.config, overrides)
      config_lib.validate(configs[name])
    except (ValueError, config_lib.ConfigError) as e:
      sys.exit(f"error: {name}: {e}")
  base = config_lib.parse(configs["ours"])
  batch = lm_batch(base.data.batch_size, base.data.max_len, base.data.vocab_size)

  entries, step_flops, extra = {}, None, {}
  for name, config in configs.items():
    print(f"compiling {name} ...", flush=True)
    entries[name], f = ours(config, batch)
    step_flops = step_flops or f
  for kind in peers:
    print(f"compiling the PyTorch peer ({kind}) ...", flush=True)
    entries[f"pytorch {kind}"], version, dev = peer(configs["ours"], batch, kind == "compiled")
    extra.update(torch=version, torch_device=dev)
  for name, run in entries.items():  # Warm-up: compiles, autotunes, fills caches.
    print(f"warming up {name} ...", flush=True)
    run(2)
  times = {name: [] for name in entries}
  for _ in range(args.rounds):
    for name, run in entries.items():
      start = time.perf_counter()
      run(args.steps)
      times[name].append((time.perf_counter() - start) / args.steps)

  device = jax.devices()[0]
  peak = flops.peak_flops(device.device_kind)
  tokens = base.data.batch_size * base.data.max_len
  results = {}
  first = statistics.median(times["ours"])
  print(f"{device.device_kind}, jax {jax.__version__}; {base.data.batch_size} x "
        f"{base.data.max_len} tokens, {step_flops / 1e12:.2f} TFLOP a step")
  for name, seconds in times.items():
    median = statistics.median(seconds)
    r = {"median_step_ms": round(median * 1e3, 2), "min_step_ms": round(min(seconds) * 1e3, 2),
         "max_step_ms": round(max(seconds) * 1e3, 2), "tokens_per_sec": round(tokens / median),
         "speed_vs_ours": round(first / median, 3)}
    if peak:
      r["mfu"] = round(step_flops / median / peak, 4)
    results[name] = r
    print(f"  {name:40s} {r['median_step_ms']:9.2f} ms  {r['tokens_per_sec']:>10,} tokens/s"
          + (f"  MFU {r['mfu']:.1%}" if peak else "") + f"  {r['speed_vs_ours']:.3f}x ours")
  record = {"command": "python benchmarks/gpt2_step.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "device": device.device_kind,
            "cpu": cpu_model(), "jax": jax.__version__, "peak_flops": peak,
            "batch": [base.data.batch_size, base.data.max_len],
            "vocab": build.padded_vocab(base.data.vocab_size), "model_flops_per_step":
            step_flops, "rounds": args.rounds, "steps_per_round": args.steps, **extra,
            "step_seconds": times, "results": results}
  if args.json:
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
