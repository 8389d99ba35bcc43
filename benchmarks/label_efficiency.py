"""What pretraining buys a classifier: the genre classifier fine-tuned from a masked language
model and from random parameters, on shares of the labelled training passages, validation and
test accuracy beside always guessing the training texts' most frequent label.

  python benchmarks/label_efficiency.py --pretrained runs/mlm_shakespeare \
      --set data.data_dir=data/shakespeare --fractions 0.05,0.2,1 --seeds 1,2 \
      --out runs/label_efficiency --json OUT.json

Each point is a real `train.py` run of `--config` (default configs/genre_shakespeare.py) in a
workdir of its own under `--out`, with `data.train_fraction` (a fixed random share of the
passages, the smaller inside the larger: data/labelled.py `subset`), `run.seed`, and
`run.init_from=--pretrained` or nothing; every other setting, the number of steps included, is
the same for every point. Validation accuracy is the run's last evaluation; the test plays are
scored once, by the trained classifier, at the end. A point whose workdir already holds its
finished run is read again rather than retrained, so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_config  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402


def last_eval(workdir: Path) -> dict:
  """The run's last evaluation line of metrics.jsonl."""
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [x for x in lines if "eval/accuracy" in x][-1]


def test_accuracy(workdir: Path, split: str) -> tuple[float, float]:
  """(the classifier's accuracy on `split`, always guessing the most frequent label of the texts
  it trained on)."""
  import numpy as np
  from transformer_jax.data import documents, labelled, pipeline
  from transformer_jax.decoding.classifier import Classifier
  from transformer_jax.decoding.inputs import split_pairs
  from transformer_jax.runs.workdir import Workdir
  texts, truth = split_pairs(str(workdir), split)
  guessed = Classifier(workdir).classify(texts)
  data_cfg = Workdir(workdir).load_config().data
  data = pipeline.prepare_labelled(data_cfg, workdir)
  trained = labelled.subset(documents.select(data.train, "the training split"),
                            data_cfg.train_fraction).ids
  majority = data.label_names[int(np.argmax(np.bincount(data.train_labels[trained])))]
  return (sum(g == t for g, t in zip(guessed, truth)) / len(truth),
          sum(t == majority for t in truth) / len(truth))


def run_point(args, fraction: float, start: str, seed: int) -> dict:
  workdir = Path(args.out) / f"{start}_f{fraction:g}_s{seed}"
  sets = [*args.set, f"data.train_fraction={fraction}", f"run.seed={seed}",
          f"run.num_steps={args.steps}"]
  if start == "pretrained":
    sets.append(f"run.init_from={args.pretrained}")
  done = workdir / "metrics.jsonl"
  began = time.perf_counter()
  if not (done.exists() and last_eval(workdir)["step"] == args.steps):
    command = [sys.executable, str(ROOT / "train.py"), "--config", args.config,
               "--workdir", str(workdir), *(f"--config.{s}" for s in sets)]
    print("+", " ".join(command), flush=True)
    proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
      last = (proc.stderr.strip().splitlines() or ["(nothing on standard error)"])[-1]
      sys.exit(f"error: the point {workdir.name} stopped (exit {proc.returncode}): {last}")
  final = last_eval(workdir)
  test, test_majority = test_accuracy(workdir, args.test_split)
  point = {"fraction": fraction, "start": start, "seed": seed, "steps": final["step"],
           "validation": round(final["eval/accuracy"], 4),
           "majority": round(final["eval/majority_accuracy"], 4), "test": round(test, 4),
           "test_majority": round(test_majority, 4),
           "seconds": round(time.perf_counter() - began, 1)}
  print(json.dumps(point), flush=True)
  return point


def table(points: list[dict]) -> list[dict]:
  """Per (fraction, start): the seeds' mean and range on both splits."""
  rows = []
  for fraction in sorted({p["fraction"] for p in points}):
    for start in ("pretrained", "random"):
      mine = [p for p in points if p["fraction"] == fraction and p["start"] == start]
      if not mine:
        continue
      row = {"fraction": fraction, "start": start, "seeds": len(mine),
             "majority": mine[0]["majority"], "test_majority": mine[0]["test_majority"]}
      for split in ("validation", "test"):
        values = [p[split] for p in mine]
        row[split] = round(statistics.mean(values), 4)
        row[f"{split}_range"] = [min(values), max(values)]
      rows.append(row)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/genre_shakespeare.py")
  parser.add_argument("--pretrained", required=True, help="the masked language model's workdir")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="a config override for every point (data.data_dir=DIR, ...)")
  parser.add_argument("--fractions", default="0.05,0.2,1")
  parser.add_argument("--seeds", default="1,2")
  parser.add_argument("--steps", type=int, default=0, help="0: the config's run.num_steps")
  parser.add_argument("--test_split", default="test")
  parser.add_argument("--out", required=True, help="a folder for the points' workdirs")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  if not (Path(args.pretrained) / "config.json").is_file():
    sys.exit(f"error: --pretrained {args.pretrained} holds no trained run (no config.json)")
  args.steps = args.steps or load_config(args.config).run.num_steps
  points = []
  for fraction in [float(f) for f in args.fractions.split(",")]:
    for seed in [int(s) for s in args.seeds.split(",")]:
      for start in ("pretrained", "random"):
        points.append(run_point(args, fraction, start, seed))
        record = {
            "command": "python benchmarks/label_efficiency.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "cores": os.cpu_count(),
            "config": args.config, "steps": args.steps, "pretrained": args.pretrained,
            "table": table(points), "points": points}
        if args.json:  # After every point: an interrupted table keeps what it measured.
          Path(args.json).parent.mkdir(parents=True, exist_ok=True)
          Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
  print(json.dumps(record["table"], indent=1))


if __name__ == "__main__":
  main()
