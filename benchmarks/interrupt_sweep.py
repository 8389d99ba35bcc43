"""Ctrl-C early in every command: each command started as from a terminal (SIGINT at its
default) and sent SIGINT at several moments after its start, many times each. Every try must
end with exit status 130 and one line, `error: ...`, as its output's last line, no traceback
and no crash; a command that ended before its signal is counted apart.

  python benchmarks/interrupt_sweep.py --translation W1 --language_model W2 \
      [--masked_model W3] [--classifier W4] --data_dir data --json OUT.json

The workdirs are trained runs of each family (smoke runs do). A table of command x moment:
tries that held, tries that ended first, and the first few that did not hold with their
output's last lines.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOMENTS = (0.1, 0.2, 0.3, 0.5, 1.0)


def commands(args, scratch: Path) -> dict[str, list[str]]:
  """Each command's arguments (after `python -m transformer_jax`), for the workdirs given."""
  data = Path(args.data_dir)
  out = lambda name: str(scratch / name)  # noqa: E731 (never written: each try is cut short)
  plan = {
      "train": ["train", "--config", "configs/fra_eng.py:smoke", "--workdir", out("train"),
                f"--config.data.data_dir={data / 'fra-eng'}",
                f"--config.data.tfds_dir={out('tfds')}"],
      "download": ["download", "--out", out("data"), "--sets", "fra-eng"],
      "aot": ["aot", "--config", "configs/fra_eng.py:smoke", "--topology", "v5e:2x2"],
  }
  if args.translation:
    w = args.translation
    plan.update({
        "translate": ["translate", "--workdir", w, "I am home.", "Go on."],
        "average": ["average", "--workdir", w, "--last", "2", "--output", out("avg")],
        "export": ["export", "--workdir", w, "--to", "huggingface", out("hf")],
        "visualize": ["visualize", "--workdir", w, "--out", out("maps"), "I am home."],
        "report": ["report", "--workdir", w, "--png", out("report.png")],
        "serve": ["serve", "--workdir", w, "--port", "0"],
    })
  if args.language_model:
    plan["generate"] = ["generate", "--workdir", args.language_model, "ROMEO.",
                        "--max_new_tokens", "8"]
  if args.masked_model:
    plan["fill"] = ["fill", "--workdir", args.masked_model, "To be or [MASK] to be"]
  if args.classifier:
    plan["classify"] = ["classify", "--workdir", args.classifier, "O Romeo, Romeo!"]
  return plan


def interrupted(argv: list[str], seconds: float, env: dict) -> dict:
  """One try: SIGINT `seconds` after the start; its exit status and last lines."""
  proc = subprocess.Popen([sys.executable, "-m", "transformer_jax", *argv], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  time.sleep(seconds)
  ended_first = proc.poll() is not None
  if not ended_first:
    proc.send_signal(signal.SIGINT)
  try:
    out = proc.communicate(timeout=300)[0]
  except subprocess.TimeoutExpired:
    proc.kill()
    out = proc.communicate()[0] + "\n(still running 300 s after the signal: killed)"
  lines = out.strip().splitlines()
  held = (proc.returncode == 130 and bool(lines) and lines[-1].startswith("error: ")
          and "Traceback" not in out and "Fatal Python error" not in out)
  return {"status": proc.returncode, "ended_first": ended_first, "held": held,
          "last_lines": lines[-4:]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--translation", help="a translation workdir")
  parser.add_argument("--language_model", help="a language model's workdir")
  parser.add_argument("--masked_model", help="a masked language model's workdir")
  parser.add_argument("--classifier", help="a classifier's workdir")
  parser.add_argument("--data_dir", default="data")
  parser.add_argument("--moments", default=",".join(map(str, MOMENTS)))
  parser.add_argument("--tries", type=int, default=10)
  parser.add_argument("--only", default="", help="commands to run, comma-separated")
  parser.add_argument("--json")
  args = parser.parse_args()
  moments = [float(m) for m in args.moments.split(",")]
  import os
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    plan = commands(args, Path(scratch))
    chosen = [c for c in plan if not args.only or c in args.only.split(",")]
    for name in chosen:
      for seconds in moments:
        tries = [interrupted(plan[name], seconds, env) for _ in range(args.tries)]
        failed = [t for t in tries if not t["held"] and not t["ended_first"]]
        row = {"command": name, "seconds": seconds, "tries": len(tries),
               "held": sum(t["held"] for t in tries),
               "ended_first": sum(t["ended_first"] for t in tries),
               "failed": failed[:3], "failures": len(failed)}
        rows.append(row)
        print(f"{name:10s} {seconds:4.1f} s  held {row['held']:2d}/{len(tries)}  ended first "
              f"{row['ended_first']}  failed {row['failures']}", flush=True)
        for t in failed[:2]:
          print("    exit", t["status"], "|", " / ".join(t["last_lines"])[-400:], flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
  sys.exit(1 if any(r["failures"] for r in rows) else 0)


if __name__ == "__main__":
  main()
