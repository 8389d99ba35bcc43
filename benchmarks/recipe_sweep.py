"""Recipes of the main job trained in turn on one machine, scored on the validation split.

  python benchmarks/recipe_sweep.py --out sweeps/fra_eng --data_dir data/fra-eng \
      --steps 600 --recipes shipped,adamw,schedule_free [--png docs/recipe_sweep.png]

Each recipe is `configs/fra_eng.py` (or --config) with its overrides (RECIPES, or NAME=FIELD=VALUE,... on the
command line), trained by train.py in a process of its own for the same number of steps (a
recipe may set run.num_steps itself: a budget of equal wall time for a slower step), one after
the other so that each sees the same machine. While a run trains, its metrics.jsonl is read
and each validation record stamped with the seconds since the process started (tokenizer,
data and compilation included): BLEU against steps and against wall time. Written: OUT/NAME
(each run's workdir), OUT/sweep.json (every recipe's overrides, curve, wall time and the
machine) and a PNG of both curves. A recipe whose workdir holds a finished run is read, not
trained again; one that fails is reported and the sweep goes on. Nothing here reads the test
set: choose on these curves, then score the chosen recipe's run once with `translate
--reference`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_model  # noqa: E402

# Each lever alone against the recipe as it ships.
RECIPES = {
    "shipped": [],  # configs/fra_eng.py as it stands: Muon at a peak of 2e-3.
    "adamw": ["optimizer.name=adamw", "optimizer.learning_rate=0.001"],  # The recipe before.
    "muon": ["optimizer.name=muon"],  # For a config on another optimizer (a smoke run's AdamW).
    "muon_lr1e-3": ["optimizer.name=muon", "optimizer.learning_rate=0.001"],
    "schedule_free": ["optimizer.name=schedule_free_adamw", "optimizer.schedule=constant",
                      "optimizer.learning_rate=0.002"],
    "wsd": ["optimizer.schedule=wsd"],
    "lr2e-3": ["optimizer.learning_rate=0.002"],
    "vocab4k": ["data.vocab_size=4000"],
    "vocab16k": ["data.vocab_size=16000"],
    "dropout0.1": ["model.dropout_rate=0.1"],
    "smoothing0.2": ["step.label_smoothing=0.2"],
    "pre_ln": ["model.pre_ln=True"],
    "deeper": ["model.num_encoder_layers=4", "model.num_decoder_layers=4"],
}


def parse_recipes(text: str) -> dict[str, list[str]]:
  """"a,b,NAME=FIELD=VALUE;FIELD=VALUE" -> {name: overrides}; known names from RECIPES."""
  recipes = {}
  for item in filter(None, text.split(",")):
    name, sep, overrides = item.partition("=")
    if sep:
      recipes[name] = [o for o in overrides.split(";") if o]
    elif name in RECIPES:
      recipes[name] = RECIPES[name]
    else:
      raise SystemExit(f"error: unknown recipe {name!r}: one of {', '.join(RECIPES)}, or "
                       "NAME=FIELD=VALUE;FIELD=VALUE")
  return recipes


def _records(metrics: Path, seen: int) -> list[dict]:
  """The complete lines of metrics.jsonl past the first `seen`."""
  if not metrics.is_file():
    return []
  lines = metrics.read_text(encoding="utf-8").splitlines()
  out = []
  for line in lines[seen:]:
    try:
      out.append(json.loads(line))
    except ValueError:
      break  # A line still being written.
  return out


def train(name: str, overrides: list[str], args) -> dict:
  """Trains one recipe (unless its workdir already finished) and returns its curve."""
  workdir = Path(args.out) / name
  done = workdir / "sweep_curve.json"
  if done.is_file():
    return json.loads(done.read_text())
  command = [sys.executable, str(ROOT / "train.py"), "--config", args.config,
             "--workdir", str(workdir), f"--config.data.data_dir={args.data_dir}",
             f"--config.run.num_steps={args.steps}", f"--config.eval.every={args.eval_every}",
             f"--config.run.checkpoint_every={args.eval_every}",
             *(f"--config.{o}" for o in (*args.common, *overrides))]
  print(f"[{name}] {' '.join(command[2:])}", flush=True)
  began = time.monotonic()
  proc = subprocess.Popen(command, cwd=args.cwd or None, stdout=subprocess.DEVNULL,
                          stderr=open(Path(args.out) / f"{name}.log", "w"))
  curve, seen = [], 0
  while True:
    finished = proc.poll() is not None
    for record in _records(workdir / "metrics.jsonl", seen):
      seen += 1
      if "eval/bleu" in record:
        point = {"step": record["step"], "seconds": round(time.monotonic() - began, 1),
                 "bleu": record["eval/bleu"], "loss": record["eval/loss"]}
        curve.append(point)
        print(f"[{name}] step {point['step']}: validation BLEU {point['bleu']:.2f} at "
              f"{point['seconds']:.0f} s", flush=True)
    if finished:
      break
    time.sleep(2)
  result = {"name": name, "overrides": overrides, "returncode": proc.returncode,
            "wall_seconds": round(time.monotonic() - began, 1), "curve": curve}
  if proc.returncode == 0:
    done.write_text(json.dumps(result))
  else:
    print(f"[{name}] failed (exit {proc.returncode}): see {Path(args.out) / (name + '.log')}",
          flush=True)
  return result


def plot(results: list[dict], png: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  for r in results:
    if not r["curve"]:
      continue
    steps, seconds, bleu = zip(*((p["step"], p["seconds"] / 60, p["bleu"]) for p in r["curve"]))
    by_step.plot(steps, bleu, marker=".", label=r["name"])
    by_time.plot(seconds, bleu, marker=".", label=r["name"])
  by_step.set(xlabel="step", ylabel="validation BLEU (256 sentences)")
  by_time.set(xlabel="minutes since the process started")
  for ax in (by_step, by_time):
    ax.grid(alpha=0.3)
  by_time.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(png, dpi=100)
  plt.close(figure)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="Folder of the runs and sweep.json.")
  parser.add_argument("--data_dir", required=True, help="fra-eng's folder (download's).")
  parser.add_argument("--recipes", default="shipped,adamw,schedule_free")
  parser.add_argument("--config", default=str(ROOT / "configs/fra_eng.py"),
                      help="The recipes' base config (a path, :ARG allowed).")
  parser.add_argument("--common", default="", help="FIELD=VALUE;... for every recipe (before "
                      "its own), e.g. data.tfds_dir=DIR.")
  parser.add_argument("--steps", type=int, default=2000, help="Steps a recipe (run.num_steps).")
  parser.add_argument("--eval_every", type=int, default=250)
  parser.add_argument("--png", default=None, help="Default: OUT/sweep.png.")
  parser.add_argument("--cwd", default=None, help="Where train.py runs (default: here).")
  args = parser.parse_args()
  recipes = parse_recipes(args.recipes)
  args.common = [o for o in args.common.split(";") if o]
  if args.steps < 1 or args.eval_every < 1:
    raise SystemExit("error: --steps and --eval_every must be positive")
  if not Path(args.data_dir).is_dir():
    raise SystemExit(f"error: --data_dir {args.data_dir} is not a directory (python -m "
                     "transformer_jax download --out data --sets fra-eng)")
  Path(args.out).mkdir(parents=True, exist_ok=True)
  args.data_dir = str(Path(args.data_dir).resolve())
  results = [train(name, overrides, args) for name, overrides in recipes.items()]
  summary = {"machine": cpu_model(), "steps": args.steps, "date": time.strftime("%Y-%m-%d"),
             "recipes": results}
  (Path(args.out) / "sweep.json").write_text(json.dumps(summary, indent=1))
  png = Path(args.png) if args.png else Path(args.out) / "sweep.png"
  plot(results, png)
  for r in results:
    best = max(r["curve"], key=lambda p: p["bleu"], default=None)
    print(f"{r['name']:<16} {'failed' if r['returncode'] else 'done':<7}"
          f"{r['wall_seconds']:>8.0f} s  last BLEU "
          f"{r['curve'][-1]['bleu'] if r['curve'] else float('nan'):6.2f}  best "
          f"{best['bleu'] if best else float('nan'):6.2f}")
  print(f"wrote {Path(args.out) / 'sweep.json'} and {png}")


if __name__ == "__main__":
  main()
