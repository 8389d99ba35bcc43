"""How much more a process's first pass over a file costs than its later ones: restores a
workdir as `translate` does (its kept programs from `--compilation_cache_dir`, loaded as they
are first called) and decodes INPUT through the decoding slots `--passes` times, printing the
time from the start to the Translator ready and each pass's time. The first pass loads the
programs and makes their first calls; the later ones are what a warm pass costs. Usage:
  python benchmarks/analysis/first_passes.py runs/fra_eng TATOEBA.eng --beam_size 1 \
      --compilation_cache_dir DIR
(DIR: where a `translate` command of the same beam size kept its programs; with none kept,
the first pass compiles them.)
"""

import time

START = time.perf_counter()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from transformer_jax.commands import launch  # noqa: E402
from transformer_jax.decoding import slots
from transformer_jax.decoding.generation import DecodeOptions  # noqa: E402
from transformer_jax.programs import ProgramStore  # noqa: E402
from transformer_jax.decoding.translator import Translator, translate_lines  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("input")
  parser.add_argument("--beam_size", type=int, default=1)
  parser.add_argument("--alpha", type=float, default=1.0)
  parser.add_argument("--passes", type=int, default=3)
  parser.add_argument("--compilation_cache_dir", default=None)
  args = parser.parse_args()
  # CLOCK_MONOTONIC's reading too: `perf record -k CLOCK_MONOTONIC` samples carry it, so
  # `perf report --time A,B` shows one pass.
  mark = lambda what: print(f"{time.perf_counter() - START:7.2f} s  {what}  (monotonic "
                            f"{time.clock_gettime(time.CLOCK_MONOTONIC):.3f})", flush=True)
  mark("imported")
  lines = Path(args.input).read_text(encoding="utf-8").splitlines()
  launch.keep_freed_memory()
  cache = launch.use_compilation_cache(args.workdir, args.compilation_cache_dir)
  programs = ProgramStore(cache / "programs")
  translator = Translator(args.workdir, programs=programs)
  mark("Translator ready")
  options = DecodeOptions(beam_size=args.beam_size, alpha=args.alpha)
  num_slots = slots.default_slots(jax.default_backend(), args.beam_size)
  for i in range(args.passes):
    mark(f"pass {i + 1} starts")
    start = time.perf_counter()
    translate_lines(translator, lines, options, 64, progress=False, num_slots=num_slots)
    mark(f"pass {i + 1}: {time.perf_counter() - start:.2f} s ({programs.compiled} programs "
         "compiled so far)")


if __name__ == "__main__":
  main()
