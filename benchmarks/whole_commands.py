"""Whole commands, from process start to the output file: `translate` against CTranslate2 on
the same weights, as a user would run each.

  python benchmarks/whole_commands.py --workdir runs/fra_eng \
      --input data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.eng \
      --reference data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.fra \
      --json benchmarks/results/NAME.json

The workdir is exported to CTranslate2 once (not timed). Then, for each beam size, one after
the other: `translate` with an empty compilation cache (the first command on a machine),
`translate` again (the cache filled: every later command), and benchmarks/ct2_translate.py;
`--rounds` times, medians reported. Both translate every line whole (`--segment_over -1`: no
sentence splitting, as CTranslate2 does) with the same alpha (each engine's own length
normalization) and 2 threads (CTranslate2's intra_threads; XLA's CPU pool on a 2-core
machine). Reported: wall seconds, sentences/s and sacreBLEU of each.

The commands run without PYTHONDONTWRITEBYTECODE, which some sandboxes set: on a user's
machine Python keeps the bytecode of the modules a first command compiled, and a later
command reads it (0.3 s of a later `translate`'s start on 2 cores where it compiled its
package's sources anew at every run, docs/translating.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_model  # noqa: E402


# Python's default: the commands keep their modules' bytecode.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _timed(argv: list[str]) -> float:
  start = time.perf_counter()
  result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=ENV)
  if result.returncode != 0:
    raise SystemExit(f"{' '.join(argv)} failed:\n{result.stderr[-3000:]}")
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--input", required=True)
  parser.add_argument("--reference", required=True)
  parser.add_argument("--beam_sizes", default="1,4")
  parser.add_argument("--alpha", type=float, default=1.0)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--slots", default="auto", help="translate's --slots.")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  import sacrebleu

  references = Path(args.reference).read_text(encoding="utf-8").splitlines()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    subprocess.run([sys.executable, "-m", "transformer_jax", "export", "--workdir", args.workdir,
                    "--to", "ctranslate2", str(tmp / "ct2")], cwd=ROOT, check=True,
                   capture_output=True)
    for beam in map(int, args.beam_sizes.split(",")):
      times: dict[str, list[float]] = {"ours, first": [], "ours": [], "ct2-float32": []}
      for r in range(args.rounds):
        cache = tmp / f"cache_{beam}_{r}"
        ours = [sys.executable, "-m", "transformer_jax", "translate", "--workdir", args.workdir,
                "--input", args.input, "--beam_size", str(beam), "--alpha", str(args.alpha),
                "--segment_over", "-1", "--long_beam_size", "0", "--slots", args.slots,
                "--compilation_cache_dir", str(cache)]
        times["ours, first"].append(_timed(ours + ["--output", str(tmp / "ours.txt")]))
        times["ours"].append(_timed(ours + ["--output", str(tmp / "ours.txt")]))
        times["ct2-float32"].append(_timed(
            [sys.executable, "benchmarks/ct2_translate.py", "--model", str(tmp / "ct2"),
             "--input", args.input, "--output", str(tmp / "ct2.txt"), "--beam_size", str(beam),
             "--alpha", str(args.alpha), "--threads", str(args.threads)]))
        print(f"beam {beam} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s"
                                                       for k, v in times.items()), flush=True)
      outputs = {name: (tmp / ("ct2.txt" if name.startswith("ct2") else "ours.txt")
                        ).read_text(encoding="utf-8").splitlines() for name in times}
      for name, seconds in times.items():
        median = statistics.median(seconds)
        rows.append({"mode": "greedy" if beam == 1 else f"beam {beam}", "command": name,
                     "median_s": median, "runs_s": seconds,
                     "sentences_per_s": len(references) / median,
                     "bleu": sacrebleu.corpus_bleu(outputs[name], [references]).score})
  header = (f"{cpu_model()}, {os.cpu_count()} cores; {len(references)} sources of "
            f"{Path(args.input).name}; {Path(args.workdir).name}; alpha {args.alpha}; translate "
            f"--slots {args.slots}; bytecode kept between commands; {time.strftime('%Y-%m-%d')}")
  print(header)
  print(f"{'mode':<8} {'command':<12} {'wall s':>7} {'sent/s':>7} {'BLEU':>6} {'vs ct2':>7}")
  for r in rows:
    base = next(b for b in rows if b["mode"] == r["mode"] and b["command"] == "ct2-float32")
    print(f"{r['mode']:<8} {r['command']:<12} {r['median_s']:>7.1f} {r['sentences_per_s']:>7.1f} "
          f"{r['bleu']:>6.2f} {r['sentences_per_s'] / base['sentences_per_s']:>6.2f}x")
  if args.json:
    Path(args.json).write_text(json.dumps({"header": header, "command": sys.argv, "rows": rows},
                                          indent=2))


if __name__ == "__main__":
  main()
