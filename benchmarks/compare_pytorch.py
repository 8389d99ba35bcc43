"""Our train step against the same model in PyTorch, timed A B A B in one process.

  pip install ".[bench]"   # torch (the CPU build: see the README's test command)
  python benchmarks/compare_pytorch.py --config configs/fra_eng.py [--rows 48 --len 48]
      [--rounds 4 --steps 5] [--compile] [--profile 3] [--set model.d_model=512 ...]
      [--json out.json]

The peer is the config's family's (PEERS), at the config's sizes, batch and lengths, on full
rows of random tokens (one sequence a row), with the config's gradient clipping:
- encoder-decoder: `torch.nn.Transformer` (post-LN, ReLU, batch_first), embeddings shared
  between source and target and tied to the output projection, sinusoidal positions,
  label-smoothed cross-entropy ignoring padding, Adam(0.9, 0.98, 1e-9);
- decoder-only: the nanoGPT-style model of lm_vs_pytorch.py (torch_block.GPT), AdamW as ours;
- encoder-only (a masked language model): `transformers`' BertForMaskedLM of
  mlm_vs_transformers.py, AdamW as ours, predicting the tokens that our step's masking rule
  chose (drawn once; ours draws its masks inside its step, and pays for that).
With --compile a third entry, the same PyTorch model and loss under `torch.compile` (inductor,
default mode), joins the round-robin: ours, eager PyTorch and compiled PyTorch A B C A B C.
--profile N then profiles N steps of each side and prints their time by profile_step.py's
buckets (matrix products, attention, reductions, elementwise, optimizer, other).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from benchmarks.common import interleaved, load_config  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.train_step import config_batch, train_setup  # noqa: E402
from transformer_jax import sharding  # noqa: E402
from transformer_jax.models import build  # noqa: E402
from transformer_jax.training import steps as step_lib  # noqa: E402


def _encoder_decoder(config, vocab: int, dev: str):
  """(model, loss(batch tensors), optimizer): torch.nn.Transformer as above."""
  import torch
  from torch import nn
  m, d = config.model, config.model.d_model

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

  def loss(t):
    return cross_entropy(model(t["inputs"], t["decoder_inputs"]).float().reshape(-1, vocab),
                         t["targets"].reshape(-1))
  return model, loss, opt


def _decoder_only(config, vocab: int, dev: str):
  """(model, loss, optimizer): the nanoGPT-style language model of lm_vs_pytorch.py."""
  import torch.nn.functional as F
  from benchmarks.torch_block import GPT, adamw
  model = GPT(config, vocab).to(dev)

  def loss(t):
    logits = model(t["decoder_inputs"], t["targets_segment_ids"], t["targets_positions"])
    targets = t["targets"].masked_fill(t["targets_segment_ids"] == 0, -100)
    return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
  return model, loss, adamw(model, config.optimizer)


def _encoder_only(config, vocab: int, dev: str):
  """(model, loss, optimizer): transformers' BertForMaskedLM of mlm_vs_transformers.py, on the
  masks our step draws (the batch's `masked_inputs` and `masked`)."""
  import torch
  import torch.nn.functional as F
  from benchmarks.mlm_vs_transformers import bert_peer
  from benchmarks.torch_block import adamw
  model = bert_peer(config, vocab).to(dev)

  def loss(t):
    seg = t["targets_segment_ids"]
    mask = (seg[:, None, :, None] == seg[:, None, None, :]) & (seg[:, None, None, :] > 0)
    mask = mask | torch.eye(seg.shape[1], dtype=torch.bool, device=seg.device)
    logits = model(input_ids=t["masked_inputs"], attention_mask=mask,
                   position_ids=t["targets_positions"]).logits
    chosen = t["masked"].bool()
    return F.cross_entropy(logits[chosen].float(), t["targets"][chosen])
  return model, loss, adamw(model, config.optimizer)


PEERS = {"encoder_decoder": _encoder_decoder, "decoder_only": _decoder_only,
         "encoder_only": _encoder_only}


def torch_step_fn(config, vocab: int, batch, compile_model: bool = False):
  """(step() -> loss, version): the config's family's PyTorch peer (PEERS) training on `batch`
  (its arrays as int64 tensors), with the config's gradient clipping; bfloat16 compute under
  autocast where the config computes in bfloat16 (float32 parameters and loss, as ours)."""
  import torch
  # The same kind of device as ours: CUDA when JAX runs on a GPU, else the CPU's every core.
  dev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  if dev == "cpu":
    torch.set_num_threads(os.cpu_count())
  model, loss_of, opt = PEERS[config.model.family](config, vocab, dev)
  model.train()
  bf16 = config.model.dtype == "bfloat16"

  def forward_loss(t):
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
      return loss_of(t)

  if compile_model:  # Forward and loss in one graph; backward compiled by AOTAutograd.
    forward_loss = torch.compile(forward_loss)
  tensors = {k: torch.from_numpy(np.asarray(v)).long().to(dev) for k, v in batch.items()}

  def step():
    opt.zero_grad(set_to_none=True)
    loss = forward_loss(tensors)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
    opt.step()
    return loss.item()
  name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
  return step, f"{torch.__version__} on {name}"


def jax_step_fn(config, batch, masking=None):
  _, mesh, state, p_train = train_setup(config, sharding.make_mesh((1, 1, 1), jax.devices()[:1]),
                                        masking)
  holder = {"state": state}
  with sharding.mesh_context(mesh):
    gbatch = sharding.global_batch(batch, mesh)

  def step():
    with sharding.mesh_context(mesh):
      holder["state"], metrics = p_train(holder["state"], gbatch)
    return float(metrics["loss"])  # Waits for the step.

  def hlo() -> str:  # The compiled step's text.
    with sharding.mesh_context(mesh):
      return p_train.lower(holder["state"], gbatch).compile().as_text()
  step.hlo = hlo
  return step


def profiles(steps: dict, calls: int) -> dict[str, dict]:
  """{side: {bucket: {ms_a_step, share}}} of `calls` steps of each side, by profile_step's
  buckets: ours from jax's trace (the timeline of the executor's thunks, XLA's kernels on a
  CPU), PyTorch's from its profiler (each operator's self time)."""
  import torch
  from benchmarks import profile_step
  out = {}
  trace = profile_step.traced(steps["jax"], calls, tempfile.mkdtemp(prefix="compare_pytorch_"))
  if jax.default_backend() == "cpu":  # Thunks named by HLO instruction: the jax op says what.
    totals = profile_step.cpu_thunk_times(trace)
    labels = {name: "" if name.startswith(("ynn_", "xnn_", "dot")) else op  # Matrix products.
              for name, op in profile_step.hlo_labels(steps["jax"].hlo()).items()}
  else:  # The device's timeline, the kernels named by their libraries.
    labels = {}
    timelines = profile_step.kernel_times(trace, labels)
    totals = max(timelines.values(), key=lambda t: sum(t.values()))
  out["jax"] = profile_step.buckets(totals, labels, calls)
  for name in (n for n in steps if n != "jax"):
    steps[name]()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
      for _ in range(calls):
        steps[name]()
    totals = collections.Counter({e.key: e.self_cpu_time_total for e in prof.key_averages()})
    out[name] = profile_step.buckets(totals, {}, calls)
  return out


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
  parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                      help="then profile STEPS steps of each side: time by bucket")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  config = load_config(args.config, args.set)
  config.data.max_len = args.len or config.data.max_len
  rows = args.rows or config.data.batch_size
  family = config.model.family
  batch = config_batch(config, rows)
  vocab = build.padded_vocab(config.data.vocab_size)
  masking = peer_batch = None
  if family == "encoder_only":  # Ours draws its masks in the step; the peer reads the same.
    vocab = build.padded_vocab(build.mask_id(config.data.vocab_size) + 1)
    masking = step_lib.Masking(mask_id=build.mask_id(config.data.vocab_size),
                               vocab_size=config.data.vocab_size, rate=config.step.mask_rate)
    peer_batch = jax.device_get(step_lib.with_masks(batch, jax.random.PRNGKey(0), masking))

  steps = {"jax": jax_step_fn(config, batch, masking)}
  steps["torch"], torch_version = torch_step_fn(config, vocab, peer_batch or batch)
  if args.compile:
    steps["torch.compile"], _ = torch_step_fn(config, vocab, peer_batch or batch,
                                              compile_model=True)
  # Each side's loss on its first step: the same batch and targets (the inits differ).
  first_loss = {name: float(step()) for name, step in steps.items()}
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
  record = {"command": "python benchmarks/compare_pytorch.py " + " ".join(sys.argv[1:]),
            "device": f"{cpu_model()} ({os.cpu_count()} cores)" if jax.default_backend() == "cpu"
            else jax.devices()[0].device_kind, "jax": jax.__version__, "family": family,
            "first_loss": first_loss, "median_s": median, "times_s": times,
            "ratio": ratios["torch"], "ratios": ratios,
            "torch": torch_version}
  if args.profile:
    record["profile"] = profiles(steps, args.profile)
    for name, by_bucket in record["profile"].items():
      print(f"{name:>13}: " + ", ".join(f"{b} {v['ms_a_step']:.1f} ms" for b, v in
                                        by_bucket.items()))
  if args.json:
    Path(args.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
  main()
