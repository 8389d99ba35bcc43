"""Where a translation decoder step's time goes, part by part, at the decoding slots' row count.

  python benchmarks/decode_profile.py --workdir runs/fra_eng --json benchmarks/results/NAME.json

On one checkpoint's weights and a batch of real sources, each part of one decoder step is
compiled alone and timed (median of --repeats calls, each waited for; the parts that carry
the cache run --loop steps in a while loop a call, as the slots do, so the cache is updated in
place, and report a step's share): the whole step as
`translate` runs it (model step and beam bookkeeping), the model's step (embedding, self- and
cross-attention, FFN, the vocabulary projection), the step without the projection, the
projection alone over the whole vocabulary in float32 and in int8 (per-channel scales, int32
sums) and over narrower shortlists, the log-sum-exp and top-k over the vocabulary, and the
beam bookkeeping alone (search.beam_step with the logits given). Rows: the slots' default
(platforms.CPU.rows, 128), one lane (translate runs two at once on a CPU).
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model, use_cpu_threads  # noqa: E402


def _timed(fn, args, repeats: int) -> float:
  """Median milliseconds of fn(*args) (compiled by a first call)."""
  import jax
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--input", default=None, help="Sources (default: one repeated sentence).")
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--width", type=int, default=16, help="Source tokens (a width class).")
  parser.add_argument("--position", type=int, default=8, help="The output position stepped.")
  parser.add_argument("--shortlists", default="512,1024,2048,4096")
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--loop", type=int, default=10,
                      help="Steps of a looped part per call (its cache carried, as in a run).")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  use_cpu_threads(args.threads)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from transformer_jax.decoding import search
  from transformer_jax.decoding.generation import SPECIALS, encode_source
  from transformer_jax.decoding.translator import Translator
  from transformer_jax.models.transformer import Transformer

  translator = Translator(args.workdir)
  model, params = translator.model, translator.params
  k, rows = args.beam_size, args.rows
  searches = rows // k
  max_len = args.width + 10
  sentences = (Path(args.input).read_text(encoding="utf-8").splitlines() if args.input else
               ["The cat sat on the mat."])
  sentences = [s for s in sentences if s.strip()][:searches]
  sentences = (sentences * searches)[:searches]
  ids = [row[:args.width - 1] + [2] for row in translator.tokenizers.src.encode(sentences)]
  src = jnp.asarray([r + [0] * (args.width - len(r)) for r in ids], jnp.int32)
  source = jax.jit(lambda p, s: encode_source(model, p, s))(params, src)
  cache = model.apply({"params": params}, rows, max_len, method=Transformer.init_cache)
  cache = {name: jax.tree.map(lambda x: x + 0.01, cache[name]) for name in ("k", "v")}
  index = jnp.full((rows,), args.position, jnp.int32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 1000, (rows, 1)), jnp.int32)
  vocab = translator.tokenizers.tgt.vocab_size

  def features(m, tokens, cache, source):  # Transformer.decode_step before its projection.
    positions = jnp.broadcast_to(jnp.reshape(cache["index"], (-1, 1)), tokens.shape)
    y = m._inputs(m.tgt_embed, tokens, positions, True)
    y, layers = m.decoder_stack.step(y, {"k": cache["k"], "v": cache["v"]},
                                     {"k": source["k"], "v": source["v"]}, cache["index"],
                                     source["valid"][:, None, None, :])
    return y[:, 0], layers

  def looped(method, keep):  # --loop steps in a while loop, the cache carried (updated in place).
    def run(p, t, c, s):
      def body(_, carry):
        c, acc = carry
        out, new = model.apply({"params": p}, t, {"index": index, **c}, s, method=method)
        return {"k": new["k"], "v": new["v"]}, acc + keep(out)
      return jax.lax.fori_loop(0, args.loop, body, (c, jnp.zeros(())))[1]
    return jax.jit(run)

  model_step = looped(Transformer.decode_step, lambda out: out[0, 0])
  feature_step = looped(features, lambda out: out[0, 0])
  y = jax.jit(lambda p, t, c, s: model.apply({"params": p}, t, {"index": index, **c}, s,
                                             method=features)[0])(params, tokens, cache, source)
  table = params["shared_embedding"]["embedding"] if "shared_embedding" in params else None
  if table is None:
    table = next(v["embedding"] for name, v in params.items() if "embed" in name)
  table = table[:vocab]  # [V, D]

  project = jax.jit(lambda y, w: y @ w.T)
  scales = jnp.max(jnp.abs(table), axis=1) / 127.0  # Per output row (a column of W^T).
  table_q = jnp.round(table / scales[:, None]).astype(jnp.int8)

  def project_int8(y, wq, s):  # Activations per row, weights per channel: int8 x int8 -> int32.
    ys = jnp.max(jnp.abs(y), axis=1, keepdims=True) / 127.0
    yq = jnp.round(y / ys).astype(jnp.int8)
    acc = jax.lax.dot_general(yq, wq, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * ys * s[None, :]

  project_int8 = jax.jit(project_int8)
  logits = project(y, table)

  def vocab_ops(logits):  # The beam step's reductions over the vocabulary.
    x = logits.reshape(searches, k, -1)
    row_top, row_idx = search.top_k(x, 2 * k)
    log_sum = jnp.log(jnp.sum(jnp.exp(x - row_top[:, :, :1]), axis=-1))
    return row_top, row_idx, log_sum

  live = jnp.full((searches, k, max_len + 1), 3, jnp.int32)
  state = (index.reshape(searches, k)[:, 0], live, jnp.zeros((searches, k)),
           live, jnp.full((searches, k), -1e9), jnp.zeros((searches, k), bool), cache)

  def bookkeeping(state, logits):
    def one(_, state):
      return search.beam_step(lambda t, c: (logits, c), state, SPECIALS, 1.0, k, "first_k",
                              positions_axis=-2, copy=translator.row_copy)
    return jax.lax.fori_loop(0, args.loop, one, state)[1]

  def whole(params, state, source):
    def one(_, state):
      return beam_step(params, state, source)
    return jax.lax.fori_loop(0, args.loop, one, state)[1]

  def beam_step(params, state, source):
    def step(t, c):
      out, c = model.apply({"params": params}, t, {"index": index, **c}, source,
                           method=Transformer.decode_step)
      return search.tokens_only(out, vocab), {"k": c["k"], "v": c["v"]}
    return search.beam_step(step, state, SPECIALS, 1.0, k, "first_k", positions_axis=-2,
                            copy=translator.row_copy)

  from transformer_jax.decoding.translator import quantized
  params8 = quantized(translator.config, params)
  source8 = jax.jit(lambda p, s: encode_source(model, p, s))(params8, src)
  parts = {
      "whole beam step": (jax.jit(whole), (params, state, source)),
      "whole beam step, int8 weights": (jax.jit(whole), (params8, state, source8)),
      "model step, int8 weights": (model_step, (params8, tokens, cache, source8)),
      "model step without the projection, int8 weights":
          (feature_step, (params8, tokens, cache, source8)),
      "model step (with projection)": (model_step, (params, tokens, cache, source)),
      "model step without the projection": (feature_step, (params, tokens, cache, source)),
      f"projection float32 [{rows},{y.shape[1]}]x[{y.shape[1]},{vocab}]": (project, (y, table)),
      f"projection int8 [{rows},{y.shape[1]}]x[{y.shape[1]},{vocab}]":
          (project_int8, (y, table_q, scales)),
  }
  for width in map(int, args.shortlists.split(",")):
    parts[f"projection float32 onto {width} pieces"] = (project, (y, table[:width]))
    parts[f"projection int8 onto {width} pieces"] = (project_int8,
                                                      (y, table_q[:width], scales[:width]))
  parts[f"log-sum-exp and top-{2 * k} over {vocab}"] = (jax.jit(vocab_ops), (logits,))
  parts["beam bookkeeping (logits given)"] = (jax.jit(bookkeeping), (state, logits))
  looped_parts = {"whole beam step", "model step (with projection)",
                  "model step without the projection", "beam bookkeeping (logits given)",
                  "whole beam step, int8 weights", "model step, int8 weights",
                  "model step without the projection, int8 weights"}
  rows_out = []
  for name, (fn, fn_args) in parts.items():
    ms = _timed(fn, fn_args, args.repeats) / (args.loop if name in looped_parts else 1)
    rows_out.append({"part": name, "ms": ms})
    print(f"{name:<55} {ms:8.3f} ms", flush=True)
  header = (f"{cpu_model()}, {os.cpu_count()} cores, {args.threads} threads; jax "
            f"{jax.__version__}; step {translator.step} of {Path(args.workdir).name}; {rows} rows "
            f"({searches} searches of beam {k}), sources of {args.width} tokens, output position "
            f"{args.position} of {max_len}; median of {args.repeats}; {time.strftime('%Y-%m-%d')}")
  print(header)
  if args.json:
    Path(args.json).write_text(json.dumps({"header": header, "command": sys.argv,
                                           "parts": rows_out}, indent=2))


if __name__ == "__main__":
  main()
