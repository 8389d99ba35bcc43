"""Where a beam search's time goes, for one batch: the decoder's steps alone, the steps plus
reordering the beams' caches, the steps plus choosing candidates, and the whole search (each
jitted, the best of 3 calls). Usage:
  python benchmarks/analysis/beam_step_profile.py WORKDIR [BATCH SOURCE_LEN BEAMS]
Sources are random ids of SOURCE_LEN tokens; every part runs SOURCE_LEN + 10 steps."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax import decode, generation
from transformer_jax.translator import Translator

workdir = sys.argv[1]
b, s, k = (int(x) for x in sys.argv[2:5]) if len(sys.argv) > 4 else (64, 16, 4)
steps = s + 10
translator = Translator(workdir)
model, params = translator.model, translator.params
src = np.random.default_rng(0).integers(4, translator.tokenizers.src.vocab_size, (b, s))
src[:, -1] = 2
src = src.astype(np.int32)


def loop(params, src, reorder: bool, choose: bool):
  """`steps` decoder steps over B*K rows, optionally reordering the caches or choosing
  candidates as beam search does at each step."""
  fn, cache = generation.decoder(model, params, src, steps)
  cache = decode.tile_beams(cache, k)

  def body(cache, i):
    logits, cache = fn(jnp.full((b * k, 1), 5, jnp.int32), cache)
    if reorder:
      cache = decode._gather_beams(cache, (jnp.arange(b * k).reshape(b, k) + i) % k, b, k)
    if choose:
      top, idx = lax.top_k(logits.reshape(b, k, -1), 2 * k)
      logits = logits + jax.nn.logsumexp(logits, -1, keepdims=True) + top.sum() + idx.sum()
    return cache, logits[:, 0]
  return lax.scan(body, cache, jnp.arange(steps))[1]


def best_of_3(fn):
  jax.block_until_ready(fn(params, src))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(fn(params, src))
    times.append(time.perf_counter() - start)
  return min(times)


parts = {
    "decoder steps": jax.jit(lambda p, x: loop(p, x, False, False)),
    "+ reordering caches": jax.jit(lambda p, x: loop(p, x, True, False)),
    "+ choosing candidates": jax.jit(lambda p, x: loop(p, x, False, True)),
    "whole beam search": jax.jit(lambda p, x: generation.beams(model, p, x, steps, k, 1.0)),
}
print(f"batch {b}, sources of {s} tokens, beam {k}, {steps} steps")
for name, fn in parts.items():
  print(f"{name:<24} {best_of_3(fn):.3f} s")
