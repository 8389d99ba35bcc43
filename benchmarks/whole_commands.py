"""Whole commands, from process start to the output file: `translate` against CTranslate2 on
the same weights, as a user would run each.

  python benchmarks/whole_commands.py --workdir runs/fra_eng \
      --input data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.eng \
      --reference data/en-fr-test/tatoeba-test-v2021-08-07.disjoint-from-fra-eng.fra \
      --json benchmarks/results/NAME.json

The workdir is exported to CTranslate2 once (not timed), with its vocabulary shortlist as the
model's vmap.txt where a variant needs it (built first if the workdir has none). Then, for each
beam size, one after the other: each `--ours` variant of `translate` with an empty compilation
cache (the first command on a machine; left out with --no_first) and again (the cache filled:
every later command), and each `--ct2` variant of benchmarks/ct2_translate.py at each of
`--ct2_limits`; `--rounds` times, medians reported. Both translate every line whole (`--segment_over -1`: no
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
import functools
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
  parser.add_argument("--ours", default="float32", help="translate's variants, comma-separated: "
                      "float32, int8 (--int8), shortlist (--shortlist), int8+shortlist.")
  parser.add_argument("--ct2", default="float32", help="CTranslate2's variants: float32, int8 "
                      "(quantized on load), each with +vmap (the workdir's shortlist as its "
                      "vocabulary map).")
  parser.add_argument("--ct2_limits", default="ours", help="CTranslate2's output limits: ours "
                      "(74, translate's most for 64-token sources), default (its own, 256).")
  parser.add_argument("--no_first", action="store_true", help="Leave out the first commands (an "
                      "empty compilation cache): each variant's cache is filled by an untimed "
                      "command before the rounds.")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  import sacrebleu

  references = Path(args.reference).read_text(encoding="utf-8").splitlines()
  ours_variants, ct2_variants = args.ours.split(","), args.ct2.split(",")
  if any("shortlist" in v for v in ours_variants) or any("vmap" in v for v in ct2_variants):
    from transformer_jax.decoding import shortlist
    shortlist.for_workdir(args.workdir)  # Built once, before export copies it as vmap.txt.
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    subprocess.run([sys.executable, "-m", "transformer_jax", "export", "--workdir", args.workdir,
                    "--to", "ctranslate2", str(tmp / "ct2")], cwd=ROOT, check=True,
                   capture_output=True)

    def ours(variant: str, beam: int, cache: Path, output: Path) -> list[str]:
      flags = {"float32": [], "int8": ["--int8"], "shortlist": ["--shortlist"],
               "int8+shortlist": ["--int8", "--shortlist"]}[variant]
      return [sys.executable, "-m", "transformer_jax", "translate", "--workdir", args.workdir,
              "--input", args.input, "--beam_size", str(beam), "--alpha", str(args.alpha),
              "--segment_over", "-1", "--long_beam_size", "0", "--slots", args.slots,
              "--compilation_cache_dir", str(cache), "--output", str(output), *flags]

    def ct2(variant: str, limit: str, beam: int, output: Path) -> list[str]:
      compute, _, vmap = variant.partition("+")
      return [sys.executable, "benchmarks/ct2_translate.py", "--model", str(tmp / "ct2"),
              "--input", args.input, "--output", str(output), "--beam_size", str(beam),
              "--alpha", str(args.alpha), "--threads", str(args.threads),
              "--compute_type", compute] + (["--vmap"] if vmap else []) + (
                  ["--default_limit"] if limit == "default" else [])

    for beam in map(int, args.beam_sizes.split(",")):
      commands: dict[str, tuple] = {}  # name -> (output file, argv for a round's cache)
      for v in ours_variants:
        name = "ours" if v == "float32" else f"ours {v}"
        out = tmp / f"{name.replace(' ', '_')}_{beam}.txt"
        commands[name] = (out, functools.partial(ours, v, beam, output=out))
      for limit in args.ct2_limits.split(","):
        for v in ct2_variants:
          name = f"ct2-{v}" + (", its limit" if limit == "default" else "")
          out = tmp / f"ct2_{v}_{limit}_{beam}.txt".replace("+", "_")
          commands[name] = (out, lambda cache, v=v, limit=limit, out=out: ct2(v, limit, beam,
                                                                              out))
      times: dict[str, list[float]] = {}
      if args.no_first:
        for name, (_, argv) in commands.items():
          if name.startswith("ours"):
            _timed(argv(tmp / f"cache_{name}_{beam}"))
      for r in range(args.rounds):
        for name, (_, argv) in commands.items():
          if name.startswith("ours") and not args.no_first:
            cache = tmp / f"cache_{name}_{beam}_{r}"
            times.setdefault(f"{name}, first", []).append(_timed(argv(cache)))
          else:
            cache = tmp / f"cache_{name}_{beam}"
          times.setdefault(name, []).append(_timed(argv(cache)))
        print(f"beam {beam} round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s"
                                                       for k, v in times.items()), flush=True)
      for name, seconds in times.items():
        output = commands[name.removesuffix(", first")][0]
        lines = output.read_text(encoding="utf-8").splitlines()
        median = statistics.median(seconds)
        rows.append({"mode": "greedy" if beam == 1 else f"beam {beam}", "command": name,
                     "median_s": median, "runs_s": seconds,
                     "sentences_per_s": len(references) / median,
                     "bleu": sacrebleu.corpus_bleu(lines, [references]).score})
  header = (f"{cpu_model()}, {os.cpu_count()} cores; {len(references)} sources of "
            f"{Path(args.input).name}; {Path(args.workdir).name}; alpha {args.alpha}; translate "
            f"--slots {args.slots}; bytecode kept between commands; {time.strftime('%Y-%m-%d')}")
  print(header)
  print(f"{'mode':<8} {'command':<28} {'wall s':>7} {'sent/s':>7} {'BLEU':>6} {'vs fastest ct2':>7}")
  for r in rows:
    base = min((b for b in rows if b["mode"] == r["mode"] and b["command"].startswith("ct2")
                and "its limit" not in b["command"]), key=lambda b: b["median_s"])
    print(f"{r['mode']:<8} {r['command']:<28} {r['median_s']:>7.1f} {r['sentences_per_s']:>7.1f} "
          f"{r['bleu']:>6.2f} {r['sentences_per_s'] / base['sentences_per_s']:>6.2f}x")
  if args.json:
    Path(args.json).write_text(json.dumps({"header": header, "command": sys.argv, "rows": rows},
                                          indent=2))


if __name__ == "__main__":
  main()
