"""Our language-model decoding against `transformers`' `generate` on the same weights: a trained
language model exported with `export --to huggingface`, greedy continuations of the same
prompt ids on both sides, in one process, timed in turn.

  pip install ".[test]"   # torch and transformers
  python benchmarks/lm_vs_transformers.py --workdir runs/lm_shakespeare \
      --data_dir data/shakespeare --json OUT.json

Two measurements, each side's calls alternating (A B A B) after two untimed calls each:
  first token   one prompt of 16, 128 and 512 tokens with <bos> (at most the model's max_len
                - 1), one new token: the time to the first token, prompt read included
  throughput    1 and --batch prompts of --prompt_len tokens at once, --new_tokens new tokens
                each (fewer where a row ends at <eos>): new tokens a second
Every continuation is compared token for token; the script exits 1 where they differ.

Ours: `prompts.continue_prompts` jitted as `generate` runs it (the prompt read in one pass,
then a `lax.while_loop` over a preallocated cache), float32. The peer: the exported
`GPT2LMHeadModel` in float32 with its default attention (`sdpa`) and cache, under
`torch.inference_mode()`, `generate(do_sample=False)` with `suppress_tokens` set to the ids ours
never continues with (<pad>, <bos>, <unk>), at --threads threads (default: every core, as
XLA's CPU client uses them). `--peer_compile` also times the peer with a static cache and
`torch.compile` of its forward pass (transformers' recipe for a compiled `generate`). `--sides
ours` times only ours (a checkout without the exporter's peer, or an older one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from transformer_jax.data import builders  # noqa: E402
from transformer_jax.data.tokenizer import BOS, EOS, PAD, UNK  # noqa: E402
from transformer_jax.decoding import prompts  # noqa: E402
from transformer_jax.decoding.completer import Completer  # noqa: E402


def prompt_ids(completer: Completer, data_dir: str, length: int, count: int,
               seed: int = 0) -> np.ndarray:
  """[count, length] ids: <bos> + length - 1 tokens of the held-out works' text from random
  offsets (the works the run did not train on)."""
  works = builders.read_documents(Path(data_dir))
  held_out = builders.document_splits(list(works))["validation"]
  ids = [t for name in held_out for t in completer.tokenizer.encode([works[name]])[0]]
  rng = random.Random(seed)
  rows = []
  for _ in range(count):
    start = rng.randrange(len(ids) - length)
    rows.append([BOS] + ids[start:start + length - 1])
  return np.array(rows, np.int32)


class Ours:
  def __init__(self, completer: Completer):
    self.completer = completer
    self.run = jax.jit(prompts.continue_prompts, static_argnums=(0, 4, 5),
                       static_argnames="vocab")

  def __call__(self, ids: np.ndarray, new: int) -> np.ndarray:
    c = self.completer
    lengths = np.full(len(ids), ids.shape[1], np.int32)
    out = self.run(c.model, c.params, jnp.asarray(ids), jnp.asarray(lengths), c.max_len, new,
                   vocab=c.tokenizer.vocab_size)
    return np.asarray(out)


class Theirs:
  def __init__(self, folder: Path, threads: int, compiled: bool):
    import torch
    import transformers
    torch.set_num_threads(threads)
    self.torch = torch
    transformers.logging.set_verbosity_error()  # Its note that max_new_tokens wins.
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).eval()
    self.kwargs = dict(do_sample=False, suppress_tokens=[PAD, BOS, UNK], eos_token_id=EOS,
                       pad_token_id=PAD)
    if compiled:
      self.kwargs["cache_implementation"] = "static"
      self.model.forward = torch.compile(self.model.forward, dynamic=False)

  def __call__(self, ids: np.ndarray, new: int) -> np.ndarray:
    torch = self.torch
    with torch.inference_mode():
      x = torch.from_numpy(ids.astype(np.int64))
      out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                min_new_tokens=0, **self.kwargs)
    out = out[:, ids.shape[1]:].numpy()
    # Ours: <pad> after a row's <eos>, and max_new columns whatever the rows did.
    rows = np.full((len(ids), new), PAD, np.int32)
    for r, row in enumerate(out):
      row = row.tolist()
      row = row[:row.index(EOS) + 1] if EOS in row else row
      rows[r, :len(row)] = row
    return rows


def new_tokens(tokens: np.ndarray) -> int:
  """New tokens made in [B, new] continuations (<eos> counts; the padding after it does not)."""
  return int(sum(min(len(row), list(row).index(EOS) + 1 if EOS in row else len(row))
                 for row in tokens.tolist()))


def timed(sides: dict, ids: np.ndarray, new: int, repeats: int) -> dict:
  """Each side's continuations of `ids` (checked equal) and median seconds, alternating."""
  outs = {}
  for name, side in sides.items():
    for _ in range(2):  # Compilation, first runs: not timed.
      outs[name] = side(ids, new)
  times = {name: [] for name in sides}
  for _ in range(repeats):
    for name, side in sides.items():
      began = time.perf_counter()
      side(ids, new)
      times[name].append(time.perf_counter() - began)
  return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                 "tokens": outs[name]} for name, t in times.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="A language model's training workdir.")
  parser.add_argument("--data_dir", default="data/shakespeare",
                      help="The works the run trained on (prompts: its held-out works).")
  parser.add_argument("--first_token_lengths", default="16,128,512")
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=128)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--sides", default="ours,transformers")
  parser.add_argument("--peer_compile", action="store_true")
  parser.add_argument("--export_dir", default=None, help="Where the export goes (default: a "
                      "temporary folder).")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  completer = Completer(args.workdir)
  sides = {}
  if "ours" in args.sides:
    sides["ours"] = Ours(completer)
  scratch = tempfile.TemporaryDirectory()
  if "transformers" in args.sides:
    folder = Path(args.export_dir or Path(scratch.name) / "hf")
    if not (folder / "config.json").is_file():
      subprocess.run([sys.executable, "-m", "transformer_jax", "export", "--workdir",
                      args.workdir, "--to", "huggingface", str(folder)], check=True, cwd=ROOT)
    sides["transformers"] = Theirs(folder, args.threads, compiled=False)
    if args.peer_compile:
      sides["transformers_compiled"] = Theirs(folder, args.threads, compiled=True)
  rows, equal = [], True
  lengths = [min(int(n), completer.max_len - 1) for n in args.first_token_lengths.split(",")]
  plan = [("first_token", n, 1, 1) for n in lengths]
  plan += [("throughput", args.prompt_len, b, args.new_tokens) for b in (1, args.batch)]
  for kind, length, batch, new in plan:
    ids = prompt_ids(completer, args.data_dir, length, batch, seed=length * 1000 + batch)
    result = timed(sides, ids, new, args.repeats)
    first = next(iter(result.values()))["tokens"]
    same = all(np.array_equal(r["tokens"], first) for r in result.values())
    equal &= same
    row = {"measure": kind, "prompt_tokens": length, "prompts": batch, "max_new_tokens": new,
           "new_tokens": new_tokens(first), "tokens_equal": same}
    for name, r in result.items():
      row[f"{name}_ms"] = round(1000 * r["median_s"], 2)
      row[f"{name}_range_ms"] = [round(1000 * r["min_s"], 2), round(1000 * r["max_s"], 2)]
      if kind == "throughput":
        row[f"{name}_tokens_per_s"] = round(new_tokens(r["tokens"]) / r["median_s"], 1)
    if "ours" in result and "transformers" in result:
      row["speedup"] = round(result["transformers"]["median_s"] / result["ours"]["median_s"], 2)
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
         "cores": os.cpu_count(), "threads": args.threads, "jax": jax.__version__,
         "model": {"max_len": completer.max_len, "d_model": completer.model.cfg.d_model,
                   "layers": completer.model.cfg.num_decoder_layers,
                   "vocab": completer.tokenizer.vocab_size},
         "rows": rows}
  if "transformers" in sides:
    import torch
    import transformers
    out.update(torch=torch.__version__, transformers=transformers.__version__)
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
  if not equal:
    sys.exit("the two sides' tokens differ")


if __name__ == "__main__":
  main()
