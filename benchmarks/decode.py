"""Decode speed: the cached scan decoder against a no-cache baseline, in one run.

  python benchmarks/decode.py [--config configs/fra_eng.py] [--workdir runs/fra_eng]
      [--out_len 64] [--repeats 10] [--json benchmarks/decode.json]

With --workdir the trained parameters are restored; otherwise the config's model is randomly
initialized (same sizes, same cost). Baseline: a Python loop calling a jitted full forward pass
(encoder and decoder) on a fixed [batch, out_len] prefix buffer at every step, no cache. Ours:
one jitted `lax.scan` (greedy) or `lax.while_loop` (beam search) with the KV cache. The
decoders are timed round-robin (A B C A B C ...), so a busy machine slows all of them alike; the
speedup is the ratio of medians. Output tokens per second count batch x out_len tokens (beam
search: the best beam's, up to out_len).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.common import interleaved, load_config  # noqa: E402
from transformer_jax import config as config_lib  # noqa: E402
from transformer_jax.models import build
from transformer_jax.decoding import generation
from transformer_jax.decoding.translator import Translator  # noqa: E402
from transformer_jax.data.tokenizer import BOS  # noqa: E402
from transformer_jax.models.transformer import Transformer  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/fra_eng.py")
  parser.add_argument("--workdir", default=None)
  parser.add_argument("--out_len", type=int, default=64)
  parser.add_argument("--src_len", type=int, default=16)
  parser.add_argument("--batches", default="1,64")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  if args.workdir:
    translator = Translator(args.workdir)
    model, params = translator.model, translator.params
  else:
    config = load_config(args.config)
    vocab = config.data.vocab_size
    model = Transformer(build.model_config(config_lib.parse(config).model, vocab, vocab))
    dummy = jnp.ones((1, 4), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), dummy, dummy)["params"])
  out_len = args.out_len
  rng = np.random.default_rng(0)

  @functools.partial(jax.jit, static_argnames=("beam_size",))
  def ours(params, src, beam_size):
    return generation.translate_ids(model, params, src, out_len, beam_size=beam_size)

  @jax.jit
  def forward(params, src, prefix):  # Full pass over the whole prefix buffer: [B, out_len, V].
    return model.apply({"params": params}, src, prefix)

  def baseline(params, src):
    prefix = np.zeros((src.shape[0], out_len), np.int32)
    prefix[:, 0] = BOS
    for t in range(out_len):
      logits = forward(params, src, jnp.asarray(prefix))
      token = np.asarray(jnp.argmax(logits[:, t], -1))
      if t + 1 < out_len:
        prefix[:, t + 1] = token
    return jnp.asarray(prefix)

  rows = []
  for batch in [int(b) for b in args.batches.split(",")]:
    src = rng.integers(4, 1000, size=(batch, args.src_len)).astype(np.int32)
    src[:, -1] = 2
    fns = {"baseline greedy (no cache)": lambda: baseline(params, src),
           "cached scan greedy": lambda: ours(params, src, beam_size=1),
           "cached beam search, beam 4": lambda: ours(params, src, beam_size=4)}
    for name, times in interleaved(fns, args.repeats).items():
      median = statistics.median(times)
      rows.append({"decoder": name, "batch": batch, "out_len": out_len, "median_s": median,
                   "min_s": min(times), "max_s": max(times),
                   "tokens_per_s": batch * out_len / median})
  for batch in {r["batch"] for r in rows}:
    base = next(r for r in rows if r["batch"] == batch and r["decoder"].startswith("baseline"))
    for r in rows:
      if r["batch"] == batch:
        r["speedup_vs_baseline"] = base["median_s"] / r["median_s"]

  device = jax.devices()[0]
  cpu = cpu_model()
  header = (f"device: {device.device_kind} x{jax.device_count()} ({cpu}, {os.cpu_count()} cores),"
            f" jax {jax.__version__}; model: d_model "
            f"{model.cfg.d_model}, {model.cfg.num_encoder_layers}+{model.cfg.num_decoder_layers} "
            f"layers, vocab {model.cfg.tgt_vocab_size}; source {args.src_len} tokens")
  print(header)
  print(f"{'decoder':<28} {'batch':>5} {'median s':>9} {'min..max s':>14} {'tokens/s':>10} "
        f"{'speedup':>8}")
  for r in sorted(rows, key=lambda r: (r["batch"], r["decoder"])):
    print(f"{r['decoder']:<28} {r['batch']:>5} {r['median_s']:>9.3f} "
          f"{r['min_s']:>6.3f}..{r['max_s']:<6.3f} {r['tokens_per_s']:>10.0f} "
          f"{r['speedup_vs_baseline']:>7.1f}x")
  if args.json:
    Path(args.json).write_text(json.dumps({"header": header, "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
