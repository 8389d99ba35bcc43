"""Probes of what a decoding step spends on a CPU, and of changes to it that were measured and not
built (docs/translating.md, "What is left of a step on the AMD EPYC"). Each probe prints its
timings (the fastest median of `--rounds` rounds of `--calls` calls, the variants alternating):

  python benchmarks/analysis/step_probes.py moved_rows runs/fra_eng TATOEBA.eng
      beam 4 slots over the first `--sources` sources of `--width` tokens: how many rows a
      step's beam search moves to another row (copying its cache), in all, in running
      searches, and in searches past their first step (whose K rows are not alike yet)
  python benchmarks/analysis/step_probes.py row_copies
      copying the moved rows' caches, 6 leaves [128, 4, 26, 64] (3 layers' keys and values of
      32 beam-4 searches) with the library's loop, from one stacked leaf, with one gather of
      every row, and each moved row only as far as its own search wrote (eighths or quarters)
  python benchmarks/analysis/step_probes.py constants runs/fra_eng
      one decoder step of the workdir's model at 4 to 128 rows, the parameters passed as
      arguments (as the slots' programs take them) against compiled in as constants
  python benchmarks/analysis/step_probes.py attention
      one attention over a cache (128 rows, 4 heads of 64) as batched products (the model's)
      against products and sums with the keys stored positions-last
  XLA_FLAGS=... python benchmarks/analysis/step_probes.py dot_paths
      3 feed-forward layers and a tied vocabulary projection of 8,000 at 4 to 128 rows: run
      once per XLA_FLAGS setting (XLA's CPU dot paths: YNN, the default; XNNPACK; oneDNN)
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import sources_of_width  # noqa: E402
from transformer_jax.decoding import search, slots  # noqa: E402
from transformer_jax.commands.translate import read_lines  # noqa: E402
from transformer_jax.decoding.generation import SPECIALS, slot_model  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402


def fastest(variants: dict, rounds: int, calls: int) -> dict[str, float]:
  """Milliseconds per call of each variant (a callable of no arguments that blocks until its
  result is ready): the fastest of `rounds` medians of `calls` calls, the variants alternating
  round by round, after a warm-up."""
  for fn in variants.values():
    for _ in range(3):
      fn()
  medians = collections.defaultdict(list)
  for _ in range(rounds):
    for name, fn in variants.items():
      times = []
      for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
      medians[name].append(np.median(times) * 1e3)
  return {name: min(values) for name, values in medians.items()}


def moved_rows(args) -> None:
  """Counts the rows each beam step's copy moves (search._copy_parents, wrapped to report)."""
  counts = collections.Counter()
  running = {}
  copy_parents, step_all = search._copy_parents, slots.SlotDecoder._step_all

  def report(moved, in_running, past_first, rows):
    counts.update(moved=int(moved), running=int(in_running), past_first=int(past_first),
                  row_steps=int(rows))

  def counted_copy(tree, parents, *rest, **kwargs):
    b, k = parents.shape
    moved = (jnp.arange(b)[:, None] * k + parents).reshape(-1) != jnp.arange(b * k)
    in_running = moved & jnp.repeat(running["mask"], k)
    jax.debug.callback(report, moved.sum(), in_running.sum(),
                       (in_running & jnp.repeat(running["t"] > 0, k)).sum(), b * k)
    return copy_parents(tree, parents, *rest, **kwargs)

  def noted_step(self, params, state, mask):  # What the step's copy is told of its searches.
    running.update(mask=mask, t=state["t"])
    return step_all(self, params, state, mask)

  lines = read_lines(args.input)
  translator = Translator(args.workdir)
  _, src = sources_of_width(translator, lines, args.width, args.sources)
  if not len(src):
    sys.exit(f"{args.input} has no source whose tokens round up to {args.width} (a multiple "
             "of 8)")
  search._copy_parents, slots.SlotDecoder._step_all = counted_copy, noted_step
  decoder = slots.SlotDecoder(slot_model(translator.model), translator.params, args.slots,
                              args.width, args.width + 10, SPECIALS, beam_size=4, alpha=1.0,
                              run_ratio=slots.RUN_RATIO["file"])
  ids = [row[row != 0] for row in np.asarray(src)]
  decoder.decode_all(ids, [args.width + 10] * len(ids))
  rows = counts["row_steps"]
  print(f"{len(ids)} sources of {args.width} tokens, {args.slots} beam-4 slots: {rows} "
        f"row-steps; moved {counts['moved']} ({counts['moved'] / rows:.1%}), in running "
        f"searches {counts['running']}, past their first step {counts['past_first']} "
        f"({counts['past_first'] / rows:.1%})")


def copy_own_prefix(tree, parents, written, fractions=(8, 4, 2, 1), axis=-2):
  """decode._copy_parents where moved row r copies only the first 1/f of the positions (the
  smallest of `fractions` that holds written[r]; 0: no copy): [B*K] leaves, parents [B, K]."""
  b, k = parents.shape
  dst = jnp.arange(b * k)
  src = (jnp.arange(b)[:, None] * k + parents).reshape(-1)
  length = min(x.shape[axis] for x in jax.tree.leaves(tree))
  sizes = [-(-length // f) for f in fractions]
  size_class = jnp.full(dst.shape, len(fractions) - 1)
  for j in reversed(range(len(fractions))):
    size_class = jnp.where(written <= sizes[j], j, size_class)
  key = jnp.where((src != dst) & (written > 0), size_class, len(fractions))
  order = jnp.argsort(key, stable=True)  # The moved rows, grouped by the part they copy.
  starts = jnp.cumsum(jnp.array([0] + [jnp.sum(key == j) for j in range(len(fractions))]))

  def copier(fraction: int):
    def copy(i, tree):
      row = order[i]

      def one(x):
        shape = [1, *x.shape[1:]]
        shape[axis % x.ndim] = -(-x.shape[axis % x.ndim] // fraction)
        zeros = (0,) * (x.ndim - 1)
        return lax.dynamic_update_slice(x, lax.dynamic_slice(x, (src[row], *zeros), shape),
                                        (row, *zeros))
      return jax.tree.map(one, tree)
    return copy

  for j, fraction in enumerate(fractions):
    tree = lax.fori_loop(starts[j], starts[j + 1], copier(fraction), tree)
  return tree


def row_copies(args) -> None:
  rng = np.random.default_rng(0)
  b, k, length = 32, 4, 26
  leaves = [tuple(jnp.asarray(rng.standard_normal((b * k, 4, length, 64), np.float32))
                  for _ in range(6))]
  stacked = [jnp.asarray(rng.standard_normal((b * k, 6, 4, length, 64), np.float32))]
  parents = np.tile(np.arange(k), (b, 1))  # About a third of the rows move, as measured.
  parents[rng.random(b) < 0.55, 3] = 0
  parents[rng.random(b) < 0.55, 2] = 0
  steps = rng.integers(0, 20, b)  # Each search's step before this one.
  written = jnp.asarray(np.repeat(np.where(steps > 0, steps + 1, 0), k).astype(np.int32))
  parents = jnp.asarray(parents.astype(np.int32))
  loop = jax.jit(lambda t, p: search._copy_parents(t, p, jnp.int32(length), -2),
                 donate_argnums=0)
  gather = jax.jit(lambda t, p: search._copy_parents(t, p, copy="gather"), donate_argnums=0)
  eighths = jax.jit(copy_own_prefix, donate_argnums=0)
  quarters = jax.jit(functools.partial(copy_own_prefix, fractions=(4, 2, 1)), donate_argnums=0)

  def call(fn, box, *extra):
    box[0] = jax.block_until_ready(fn(box[0], parents, *extra))

  moved = int((np.asarray(parents) != np.arange(k)).sum())
  print(f"{moved} of {b * k} rows moved, their searches at steps 0-19 of {length} positions")
  times = fastest({"the library's loop (whole rows)": lambda: call(loop, leaves),
                   "one stacked leaf, the same loop": lambda: call(loop, stacked),
                   "a gather of every row": lambda: call(gather, leaves),
                   "each row its own part, eighths": lambda: call(eighths, leaves, written),
                   "each row its own part, quarters": lambda: call(quarters, leaves, written)},
                  args.rounds, args.calls)
  for name, ms in times.items():
    print(f"{ms:8.3f} ms  {name}")


def constants(args) -> None:
  translator = Translator(args.workdir)
  model = slot_model(translator.model, translator.tokenizers.tgt.vocab_size)
  params = translator.params
  as_numpy = jax.tree.map(np.asarray, params)
  passed = jax.jit(model.step)
  compiled_in = jax.jit(lambda *a: model.step(as_numpy, *a))
  width, length = 16, 26
  for rows in (4, 16, 32, 128):
    sources = model.encode(params, jnp.full((rows, width), 5, jnp.int32), width)
    cache = model.init_cache(params, rows, length)
    tokens, index = jnp.full((rows, 1), 7, jnp.int32), jnp.full((rows,), 5, jnp.int32)
    times = fastest({
        "arguments": lambda: jax.block_until_ready(passed(params, tokens, cache, sources, index)),
        "constants": lambda: jax.block_until_ready(compiled_in(tokens, cache, sources, index))},
        args.rounds, args.calls)
    print(f"{rows:4d} rows: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items()))


def attention(args) -> None:
  rng = np.random.default_rng(0)
  rows, heads, dim = 128, 4, 64

  def softmax(logits, mask):
    return jax.nn.softmax(jnp.where(mask, logits / np.sqrt(dim), -1e30), axis=-1)

  @jax.jit
  def products(q, k, v, mask):  # q [R, 1, N, H], k, v [R, N, S, H]: the model's.
    logits = jnp.einsum("btnh,bnsh->bnts", q, k)
    return jnp.einsum("bnts,bnsh->bnth", softmax(logits, mask[:, None, None]), v)[:, :, 0]

  @jax.jit
  def sums(q, k_last, v, mask):  # k_last [R, N, H, S]: each sum over a leading axis.
    logits = jnp.sum(q[:, 0, :, :, None] * k_last, axis=2)  # [R, N, S]
    return jnp.sum(softmax(logits, mask[:, None])[..., None] * v, axis=2)  # [R, N, H]

  for positions in (16, 26, 42, 74):
    q = jnp.asarray(rng.standard_normal((rows, 1, heads, dim), np.float32))
    k = rng.standard_normal((rows, heads, positions, dim), np.float32)
    v = jnp.asarray(rng.standard_normal((rows, heads, positions, dim), np.float32))
    k_last, k = jnp.asarray(np.swapaxes(k, 2, 3).copy()), jnp.asarray(k)
    mask = jnp.asarray(np.arange(positions) < rng.integers(1, positions, (rows, 1)))
    np.testing.assert_allclose(products(q, k, v, mask), sums(q, k_last, v, mask), atol=1e-5)
    times = fastest({
        "batched products": lambda: jax.block_until_ready(products(q, k, v, mask)),
        "products and sums": lambda: jax.block_until_ready(sums(q, k_last, v, mask))},
        args.rounds, args.calls)
    print(f"{positions:3d} positions: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items()))


def dot_paths(args) -> None:
  rng = np.random.default_rng(0)
  weights = [jnp.asarray(rng.standard_normal(shape, np.float32) / 16)
             for shape in [(256, 1024), (1024, 256)] * 3 + [(8000, 256)]]

  @jax.jit
  def layers(x, weights):  # x [R, D]; 3 feed-forward layers, then the tied projection.
    for wi, wo in zip(weights[:6:2], weights[1:6:2]):
      x = x + jax.nn.relu(x @ wi) @ wo
    return jnp.argmax(jnp.einsum("rd,vd->rv", x, weights[6]), axis=-1)

  out = []
  for rows in (4, 16, 64, 128):
    x = jnp.asarray(rng.standard_normal((rows, 256), np.float32))
    times = fastest({"": lambda: jax.block_until_ready(layers(x, weights))}, args.rounds,
                    args.calls)
    out.append(f"{rows} rows {times['']:.2f} ms")
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: " + ", ".join(out))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  probes = {"moved_rows": moved_rows, "row_copies": row_copies, "constants": constants,
            "attention": attention, "dot_paths": dot_paths}
  parser.add_argument("probe", choices=list(probes))
  parser.add_argument("workdir", nargs="?", help="moved_rows, constants: the trained workdir.")
  parser.add_argument("input", nargs="?", help="moved_rows: a file of source sentences.")
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--sources", type=int, default=800)
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--calls", type=int, default=40)
  args = parser.parse_args()
  if args.probe in ("moved_rows", "constants") and not args.workdir:
    parser.error(f"{args.probe} needs a workdir")
  if args.probe == "moved_rows" and not args.input:
    parser.error("moved_rows needs an input file")
  probes[args.probe](args)


if __name__ == "__main__":
  main()
