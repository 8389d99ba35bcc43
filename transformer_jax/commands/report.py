"""Where a run's hours went: its goodput ledger, and its curves drawn to a PNG.

  python -m transformer_jax report --workdir runs/fra_eng [--png runs/fra_eng/report.png]

Prints the ledger (training/goodput.py) added up over the run's lives, each life in a line,
then draws training loss, the validation metric (BLEU, accuracy or loss), tokens/s and
goodput against the step from metrics.jsonl. A run still training can be read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from absl import app, flags

from transformer_jax import errors, fs
from transformer_jax.commands import launch
from transformer_jax.runs.workdir import check_file_outside_runs


class ReportError(errors.UserError):
  """A workdir without the files a report reads."""


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Training workdir.")
  flags.DEFINE_string("png", None, "Where to draw the curves; default: WORKDIR/report.png.")


def ledger_lines(lines: list[dict]) -> list[str]:
  """The ledger as text: the buckets over every life, then one line a life."""
  from transformer_jax.training import goodput
  total = goodput.summary(lines)
  wall = total["wall"]
  out = [f"{total['lives']} {'life' if total['lives'] == 1 else 'lives'}, {wall:,.1f} s of "
         f"wall time, step {total['step']:,} reached; goodput {100 * total['goodput']:.1f}%"]
  for bucket in goodput.BUCKETS:
    seconds = total["seconds"][bucket]
    note = f"  ({total['recomputed_steps']:,} steps)" if bucket == "recomputed" else ""
    out.append(f"  {bucket:<11}{seconds:>11,.1f} s {100 * seconds / max(wall, 1e-9):6.1f}%{note}")
  for line in lines:
    out.append(f"life {line['life']}: process {line['pid']} on {line['host']}, steps "
               f"{line['from_step']:,} -> {line['step']:,} in "
               f"{line['updated'] - line['started']:,.1f} s, {line['recomputed_steps']:,} "
               "of them done again")
  return out


def _curves(records: list[dict], png: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  evaluated = next((k for k in ("eval/bleu", "eval/accuracy", "eval/loss")
                    if any(k in r for r in records)), "eval/loss")
  panels = (("train/loss", "training loss"), (evaluated, evaluated.replace("eval/", "validation ")),
            ("train/tokens_per_sec", "tokens/s"), ("train/goodput", "goodput (share of wall time)"))
  figure, axes = plt.subplots(2, 2, figsize=(10, 7))
  for ax, (key, title) in zip(axes.flat, panels):
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    if points:
      ax.plot(*zip(*points), marker="." if len(points) < 30 else None)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  figure.tight_layout()
  partial = png.with_name(f".{png.name}.partial")
  figure.savefig(partial, format="png", dpi=100)
  plt.close(figure)
  os.replace(partial, png)


def main(argv):
  F = flags.FLAGS
  with errors.reported():
    if len(argv) > 1:
      raise ReportError(f"unexpected arguments {argv[1:]}")
    if not F.workdir:
      raise ReportError("usage: report --workdir DIR [--png FILE]")
    workdir = Path(F.workdir)
    from transformer_jax.training import goodput
    if not workdir.exists():
      raise ReportError(f"--workdir {workdir} does not exist")
    if not workdir.is_dir():
      raise ReportError(f"--workdir {workdir} is a file, not a training workdir")
    lines = goodput.read(workdir / goodput.FILE)
    metrics = workdir / "metrics.jsonl"
    if not lines or not metrics.is_file():  # Say what is there and what is not.
      empty = " (it is empty)" if (workdir / goodput.FILE).is_file() else ""
      missing = ([goodput.FILE + empty] if not lines else []) + (
          [] if metrics.is_file() else ["metrics.jsonl"])
      only = goodput.FILE if lines else ("metrics.jsonl" if metrics.is_file() else "")
      raise ReportError(f"{workdir} holds no {' and no '.join(missing)}"
                        + (f" (only {only})" if only else "")
                        + ": train.py writes both from its first step")
    try:
      text = metrics.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
      raise ReportError(f"{metrics} is not UTF-8 text (byte {e.start}): not a run's "
                        "metrics") from None
    records = []
    for raw in text.splitlines():
      try:
        record = json.loads(raw)
      except ValueError:
        continue  # A torn last line of a killed run.
      if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
        records.append(record)
    png = Path(F.png) if F.png else workdir / "report.png"
    fs.check_output_file(png, "--png")
    check_file_outside_runs(png, "--png", may_add="png")  # Beside the run's files, not over one.
    fs.check_replaceable(png, "--png", "png")
    print(f"{workdir}: " + "\n".join(ledger_lines(lines)))
    _curves(records, png)
    print(f"curves: {png}")


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
