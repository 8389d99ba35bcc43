"""Our language model against a nanoGPT-style PyTorch peer of the same size, in one run: each
trains for the same wall time on the same batches, then both are scored on the same held-out
works in bits per character.

  pip install ".[bench]"   # torch
  python benchmarks/lm_vs_pytorch.py --config configs/lm_shakespeare.py \
      --set data.data_dir=data/shakespeare --seconds 300 --json OUT.json

The PyTorch side is written here: token and learned position embeddings, pre-LN blocks of causal
self-attention (one fused q/k/v projection, `scaled_dot_product_attention` with the rows'
segment mask, so packed documents stay apart as in ours) and a ReLU FFN, a final LayerNorm and
an output tied to the embedding; AdamW with the config's betas, epsilon, weight decay (matrices
only), global-norm clipping and the same warmup-cosine learning rate at every step; dropout as
the config's. Both sides read the same packed rows (`pipeline.document_stream` with the same seed)
and are scored on the same eval rows. Compilation (ours) is timed apart from the training time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import load_config  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from transformer_jax import config as config_lib, sharding  # noqa
from transformer_jax.models import build
from transformer_jax.models import flops
from transformer_jax.training import steps as step_lib
from transformer_jax.data import documents, pipeline  # noqa: E402


def train_ours(cfg, data, eval_data, seconds: float) -> dict:
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  model = build.build_model(build.model_config(
      cfg.model, data.tokenizers.src.vocab_size, data.tokenizers.tgt.vocab_size,
      max_len=cfg.data.max_len))
  state, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(cfg.optimizer, cfg.run.num_steps), cfg.run.seed, mesh,
      cfg.data.max_len)
  p_train, p_eval = step_lib.jit_steps(shardings, mesh, cfg.step)
  stream = _train_stream(cfg, data)
  put = lambda b: sharding.global_batch(b, mesh)
  with sharding.mesh_context(mesh):
    start = time.perf_counter()
    first = next(stream)  # Its model FLOPs stand for every step's (rows of one shape).
    state, metrics = p_train(state, put(first))
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    times, tokens, steps = [], [], 1
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds and steps < cfg.run.num_steps:
      t0 = time.perf_counter()
      state, metrics = p_train(state, put(next(stream)))
      tokens.append(float(metrics["tokens"]))  # Waits for the step.
      times.append(time.perf_counter() - t0)
      steps += 1
    trained_s = time.perf_counter() - begin
    sums = [p_eval(state, put(b)) for b in eval_data]
  stream.close()
  nll = float(sum(float(s["nll_sum"]) for s in sums))
  step_flops = flops.batch_flops(model.cfg, first)
  return _summary(steps, times, tokens, trained_s, nll, compile_seconds=round(compile_s, 1),
                  model_flops_per_sec=round(step_flops / statistics.median(times)))


def _train_stream(cfg, data):
  return pipeline.document_stream(data.train, batch_size=cfg.data.batch_size,
                                  max_len=cfg.data.max_len, seed=cfg.run.seed,
                                  pack=cfg.data.packing)


def _summary(steps, times, tokens, trained_s, nll, **extra) -> dict:
  median = statistics.median(times)
  return {"steps": steps, "trained_seconds": round(trained_s, 1),
          "median_step_ms": round(median * 1e3, 1), "min_step_ms": round(min(times) * 1e3, 1),
          "max_step_ms": round(max(times) * 1e3, 1),
          "tokens_per_sec": round(statistics.median(tokens) / median), "eval_nll_sum": nll,
          **extra}


def train_torch(cfg, data, eval_data, seconds: float) -> dict:
  import torch
  import torch.nn.functional as F
  from benchmarks.torch_block import GPT, adamw
  dev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  if dev == "cpu":
    torch.set_num_threads(os.cpu_count())
  torch.manual_seed(cfg.run.seed)
  m = cfg.model
  vocab = build.padded_vocab(data.tokenizers.tgt.vocab_size)
  model = GPT(cfg, vocab).to(dev)
  o = cfg.optimizer
  opt = adamw(model, o)
  schedule = step_lib.learning_rate_schedule(o, cfg.run.num_steps)
  bf16 = m.dtype == "bfloat16"

  def tensors(batch):
    return [torch.from_numpy(np.asarray(batch[k])).long().to(dev)
            for k in ("decoder_inputs", "targets_segment_ids", "targets_positions", "targets")]

  def loss_of(batch, reduction="mean"):
    tokens, segments, positions, targets = tensors(batch)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
      logits = model(tokens, segments, positions)
    targets = torch.where(segments > 0, targets, -100)
    return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1),
                           ignore_index=-100, reduction=reduction), int((segments > 0).sum())

  def step(batch, number):
    for group in opt.param_groups:
      group["lr"] = float(schedule(number))
    loss, n = loss_of(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if o.grad_clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    opt.step()
    loss.item()  # Waits for the step.
    return n

  stream = _train_stream(cfg, data)
  model.train()
  start = time.perf_counter()
  step(next(stream), 0)
  first_s = time.perf_counter() - start
  times, tokens, steps = [], [], 1
  begin = time.perf_counter()
  while time.perf_counter() - begin < seconds and steps < cfg.run.num_steps:
    t0 = time.perf_counter()
    tokens.append(step(next(stream), steps))
    times.append(time.perf_counter() - t0)
    steps += 1
  trained_s = time.perf_counter() - begin
  stream.close()
  model.eval()
  with torch.no_grad():
    nll = float(sum(loss_of(b, "sum")[0].item() for b in eval_data))
  return _summary(steps, times, tokens, trained_s, nll, first_step_seconds=round(first_s, 1),
                  torch=torch.__version__, device=dev)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_shakespeare.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--seconds", type=float, default=300.0,
                      help="training wall time of each side (after ours compiles)")
  parser.add_argument("--eval_batches", type=int, default=0, help="0: the whole eval split")
  parser.add_argument("--workdir", default=None, help="where the tokenizer is kept (default: a "
                      "temporary directory)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  cfg = config_lib.parse(load_config(args.config, args.set))
  workdir = args.workdir or tempfile.mkdtemp(prefix="lm_vs_pytorch-")
  data = pipeline.prepare_documents(cfg.data, workdir)
  eval_data = documents.eval_batches(data.eval, batch_size=cfg.eval.batch_size,
                                     max_len=cfg.data.max_len, pack=cfg.data.packing)
  if args.eval_batches:
    eval_data = eval_data[:args.eval_batches]
  chars = documents.characters(eval_data, data.tokenizers.tgt)
  unigram = documents.unigram_bits(data.train, eval_data, data.tokenizers.tgt.vocab_size) / chars
  results = {}
  for name, train in (("jax", train_ours), ("torch", train_torch)):
    print(f"Training {name} for {args.seconds:.0f} s ...", flush=True)
    results[name] = train(cfg, data, eval_data, args.seconds)
    results[name]["bits_per_char"] = round(results[name]["eval_nll_sum"] / math.log(2) / chars,
                                           4)
    print(name, json.dumps(results[name]), flush=True)
  m = cfg.model
  record = {
      "command": "python benchmarks/lm_vs_pytorch.py " + " ".join(sys.argv[1:]),
      "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
      "cpu": cpu_model(), "cores": os.cpu_count(), "jax": jax.__version__,
      "model": f"{m.num_decoder_layers} layers, d_model {m.d_model}, {m.num_heads} heads, FFN "
               f"{m.ffn_dim}, {m.positions} positions, vocab {data.tokenizers.tgt.vocab_size}, "
               f"{m.dtype}",
      "batch": f"{cfg.data.batch_size} x {cfg.data.max_len}",
      "eval_characters": chars, "unigram_bits_per_char": round(unigram, 4),
      "seconds_each": args.seconds, **results}
  print(json.dumps(record, indent=1))
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
