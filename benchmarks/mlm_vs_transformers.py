"""Our masked language model against `transformers`' BertForMaskedLM of the same shape, trained
on the same batches with the same masks for the same steps, both scored on the same held-out
masks: masked-token accuracy every `--every` steps, for each seed.

  pip install ".[test]"   # torch and transformers
  python benchmarks/mlm_vs_transformers.py --config configs/mlm_shakespeare.py \
      --set data.data_dir=data/shakespeare --steps 1500 --every 250 --seeds 1,2 --json OUT.json

The peer is `BertForMaskedLM(BertConfig(...))` with the config's layers, d_model, heads, FFN,
GELU, learned positions, post-LN blocks, LayerNorm epsilon, dropout on the residual branches
(ours has no attention-probability dropout, so neither has the peer) and the output tied to the
embedding, initialised by `transformers` as BERT is (N(0, 0.02) weights). Its attention mask is
our rows' segment mask ([B, 1, T, T]: packed chunks never read each other). Both sides use
AdamW with the config's betas, epsilon, weight decay (matrices only), global-norm clipping and
the same learning rate at every step (`steps.learning_rate_schedule`). The batches are
`pipeline.document_stream`'s with the run's seed, and the peer's masks are drawn by our
`steps.with_masks` from the keys our train step draws its own from (`steps.mask_key`), so both
sides predict the same tokens from the same inputs (the script checks the counts agree); the
held-out masks are the trainer's (`steps.masked_once`). Only dropout's draws differ.
"""

from __future__ import annotations

import argparse
import json
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
from transformer_jax import config as config_lib, sharding  # noqa: E402
from transformer_jax.data import documents, pipeline  # noqa: E402
from transformer_jax.models import build  # noqa: E402
from transformer_jax.training import steps as step_lib  # noqa: E402


def _stream(cfg, data):
  return pipeline.document_stream(data.train, batch_size=cfg.data.batch_size,
                                  max_len=cfg.data.max_len, seed=cfg.run.seed,
                                  pack=cfg.data.packing)


def _point(step, sums, seconds) -> dict:
  """One point of a curve from summed eval statistics."""
  tokens = max(float(sums["tokens"]), 1.0)
  return {"step": step, "accuracy": round(float(sums["correct"]) / tokens, 4),
          "loss": round(float(sums["nll_sum"]) / tokens, 4), "train_seconds": round(seconds, 1)}


def train_ours(cfg, data, eval_data, masking, steps: int, every: int) -> dict:
  """Our train step (masks drawn inside it) for `steps` steps; the curve and the state's key."""
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  model = build.build_model(build.model_config(
      cfg.model, data.tokenizers.src.vocab_size, data.tokenizers.tgt.vocab_size,
      max_len=cfg.data.max_len))
  state, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(cfg.optimizer, cfg.run.num_steps), cfg.run.seed, mesh,
      cfg.data.max_len)
  p_train, p_eval = step_lib.jit_steps(shardings, mesh, cfg.step, masking)
  put = lambda b: sharding.global_batch(b, mesh)
  stream = _stream(cfg, data)
  curve, times, masked = [], [], 0.0
  with sharding.mesh_context(mesh):
    for step in range(1, steps + 1):
      start = time.perf_counter()
      state, metrics = p_train(state, put(next(stream)))
      masked += float(metrics["masked_tokens"])  # Waits for the step.
      times.append(time.perf_counter() - start)
      if step % every == 0 or step == steps:
        sums = jax.tree.map(lambda *x: sum(x), *[p_eval(state, put(b)) for b in eval_data])
        curve.append(_point(step, sums, sum(times)))
        print(f"  jax step {step}: {json.dumps(curve[-1])}", flush=True)
  stream.close()
  return {"curve": curve, "median_step_ms": round(statistics.median(times[1:]) * 1e3, 1),
          "first_step_seconds": round(times[0], 1), "masked_tokens": masked,
          "mask_rng": state.rng}


def bert_peer(cfg, vocab: int):
  """transformers' BertForMaskedLM of the config's shape, as BERT initialises it."""
  from transformers import BertConfig, BertForMaskedLM
  m = cfg.model
  return BertForMaskedLM(BertConfig(
      vocab_size=vocab, hidden_size=m.d_model, num_hidden_layers=m.num_encoder_layers,
      num_attention_heads=m.num_heads, intermediate_size=m.ffn_dim, hidden_act="gelu",
      hidden_dropout_prob=m.dropout_rate, attention_probs_dropout_prob=0.0,
      max_position_embeddings=cfg.data.max_len, type_vocab_size=1,
      layer_norm_eps=m.layer_norm_eps, tie_word_embeddings=True, pad_token_id=0,
      attn_implementation="sdpa"))


def train_bert(cfg, data, eval_data, masking, steps: int, every: int, mask_rng) -> dict:
  """The peer on the same batches, with the masks our step drew from `mask_rng`."""
  import torch
  import torch.nn.functional as F
  from benchmarks.torch_block import adamw
  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(cfg.run.seed)
  vocab = build.padded_vocab(build.mask_id(data.tokenizers.tgt.vocab_size) + 1)  # As ours.
  model = bert_peer(cfg, vocab)
  o = cfg.optimizer
  opt = adamw(model, o)
  schedule = step_lib.learning_rate_schedule(o, cfg.run.num_steps)
  draw = jax.jit(step_lib.with_masks, static_argnums=2)

  def loss_sums(batch, reduction):
    """(loss, correct, predicted tokens) over a masked batch's chosen tokens."""
    t = {k: torch.from_numpy(np.asarray(batch[k])).long()
         for k in ("masked_inputs", "targets_segment_ids", "targets_positions", "targets")}
    seg = t["targets_segment_ids"]
    # [B, 1, T, T]: a token reads its own segment; padding reads itself only (no empty row).
    mask = (seg[:, None, :, None] == seg[:, None, None, :]) & (seg[:, None, None, :] > 0)
    mask = mask | torch.eye(seg.shape[1], dtype=torch.bool)
    logits = model(input_ids=t["masked_inputs"], attention_mask=mask,
                   position_ids=t["targets_positions"]).logits
    chosen = torch.from_numpy(np.asarray(batch["masked"]))
    picked, targets = logits[chosen].float(), t["targets"][chosen]
    loss = F.cross_entropy(picked, targets, reduction=reduction)
    correct = (picked.argmax(-1) == targets).sum().item()
    return loss, correct, int(chosen.sum())

  def evaluate():
    model.eval()
    total = {"nll_sum": 0.0, "correct": 0.0, "tokens": 0.0}
    with torch.no_grad():
      for batch in eval_data:
        loss, correct, n = loss_sums(batch, "sum")
        total["nll_sum"] += loss.item()
        total["correct"] += correct
        total["tokens"] += n
    model.train()
    return total

  stream = _stream(cfg, data)
  curve, times, masked = [], [], 0.0
  model.train()
  for step in range(1, steps + 1):
    batch = draw(next(stream), step_lib.mask_key(mask_rng, step - 1), masking)
    batch = jax.device_get(batch)
    start = time.perf_counter()
    for group in opt.param_groups:
      group["lr"] = float(schedule(step - 1))
    loss, _, n = loss_sums(batch, "mean")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if o.grad_clip:
      torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    opt.step()
    masked += n
    times.append(time.perf_counter() - start)
    if step % every == 0 or step == steps:
      curve.append(_point(step, evaluate(), sum(times)))
      print(f"  bert step {step}: {json.dumps(curve[-1])}", flush=True)
  stream.close()
  return {"curve": curve, "median_step_ms": round(statistics.median(times[1:]) * 1e3, 1),
          "masked_tokens": masked, "torch": torch.__version__}


def constant_baseline(cfg, data, eval_data, masking, batches: int = 100) -> dict:
  """Always guessing the piece most often masked in `batches` training batches: its accuracy
  on the held-out masks."""
  draw = jax.jit(step_lib.with_masks, static_argnums=2)
  stream, counts = _stream(cfg, data), np.zeros(masking.mask_id + 1, np.int64)
  for i in range(batches):
    batch = jax.device_get(draw(next(stream), jax.random.PRNGKey(i), masking))
    counts += np.bincount(batch["targets"][batch["masked"]], minlength=len(counts))
  stream.close()
  piece = int(np.argmax(counts))
  right = sum(int((b["targets"][b["masked"]] == piece).sum()) for b in eval_data)
  total = sum(int(b["masked"].sum()) for b in eval_data)
  return {"piece": data.tokenizers.tgt.decode([piece]), "accuracy": round(right / total, 4)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/mlm_shakespeare.py")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
  parser.add_argument("--steps", type=int, default=0, help="steps of each side (0: the "
                      "config's run.num_steps; the schedule is always the config's)")
  parser.add_argument("--every", type=int, default=250, help="evaluate every this many steps")
  parser.add_argument("--seeds", default="1,2", help="comma-separated run.seed values")
  parser.add_argument("--eval_batches", type=int, default=0, help="0: the whole eval split")
  parser.add_argument("--workdir", default=None, help="where the tokenizer is kept (default: a "
                      "temporary directory)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  base = load_config(args.config, args.set)
  cfg = config_lib.parse(base)
  if cfg.model.family != "encoder_only" or cfg.model.pre_ln or cfg.model.positions != "learned":
    sys.exit("error: the peer is BERT: --config must be an encoder_only model with post-LN "
             "blocks and learned positions")
  steps = args.steps or cfg.run.num_steps
  seeds = [int(s) for s in args.seeds.split(",")]
  workdir = args.workdir or tempfile.mkdtemp(prefix="mlm_vs_transformers-")
  data = pipeline.prepare_documents(cfg.data, workdir)
  rows = documents.eval_batches(data.eval, batch_size=cfg.eval.batch_size,
                                max_len=cfg.data.max_len, pack=cfg.data.packing)
  if args.eval_batches:
    rows = rows[:args.eval_batches]
  masking = step_lib.masking_rule(data.tokenizers.tgt.vocab_size, cfg.step, data.tokenizers.tgt)
  runs = {"jax": {}, "bert": {}}
  for seed in seeds:
    base.run.seed = seed
    cfg = config_lib.parse(base)
    eval_data = step_lib.masked_once(rows, masking, seed)  # As train.py masks them.
    ours = train_ours(cfg, data, eval_data, masking, steps, args.every)
    peer = train_bert(cfg, data, eval_data, masking, steps, args.every, ours.pop("mask_rng"))
    if peer["masked_tokens"] != ours["masked_tokens"]:
      sys.exit(f"error: the sides predicted {ours['masked_tokens']:.0f} and "
               f"{peer['masked_tokens']:.0f} tokens: their masks differ")
    runs["jax"][seed], runs["bert"][seed] = ours, peer
  m = cfg.model
  record = {
      "command": "python benchmarks/mlm_vs_transformers.py " + " ".join(sys.argv[1:]),
      "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
      "cpu": cpu_model(), "cores": os.cpu_count(), "jax": jax.__version__,
      "model": f"{m.num_encoder_layers} post-LN layers, d_model {m.d_model}, {m.num_heads} heads, "
               f"FFN {m.ffn_dim}, {m.activation}, learned positions, vocab "
               f"{data.tokenizers.tgt.vocab_size}, embed_norm {m.embed_norm}",
      "batch": f"{cfg.data.batch_size} x {cfg.data.max_len}", "steps": steps,
      "eval_masked_tokens": int(sum(b["masked"].sum() for b in eval_data)),
      # On the last seed's held-out masks.
      "most_frequent_piece": constant_baseline(cfg, data, eval_data, masking),
      "runs": runs, "accuracy_by_step": accuracy_by_step(runs)}
  print(json.dumps(record, indent=1))
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def accuracy_by_step(runs: dict) -> dict:
  """{side: {step: [accuracy of each seed]}}: the curves side by side."""
  table = {}
  for side, by_seed in runs.items():
    table[side] = {}
    for result in by_seed.values():
      for point in result["curve"]:
        table[side].setdefault(point["step"], []).append(point["accuracy"])
  return table


if __name__ == "__main__":
  main()
