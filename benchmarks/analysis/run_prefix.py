"""What a run of fewer searches than slots costs beyond its steps: the run program of the first
`rows` slots copies their state (caches and sources) out of the whole state and back, once a
call. Times one call of `--steps` steps with A searches active, in a decoder of `--slots` slots
(the run of the first A slots) and in one of exactly A slots (a run of the whole state), with
the page faults each call took. The process keeps its freed memory as `translate` and `serve`
do (launch.keep_freed_memory); `--glibc_defaults` leaves glibc's malloc as it is, which maps
a block over 32 MB afresh at each allocation.

  python benchmarks/analysis/run_prefix.py runs/fra_eng --beam_size 4 --width 16 --slots 32 \
      --active 8,16 --steps 1,4 --json run_prefix.json

The workdir's model and parameters; the sources are token ids drawn uniformly (`--width` - 1
tokens and <eos>), each search's output limit `--width` + the decoding margin (a server's
slots for that width class), filled again before each call. Medians of `--repeats` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks.analysis.slot_steps import timed_runs  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from transformer_jax.commands import launch  # noqa: E402
from transformer_jax.decoding import slots
from transformer_jax.decoding.generation import SPECIALS, DecodeOptions, slot_model  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--beam_size", type=int, default=4)
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--active", default="8,16", help="Active searches, comma-separated.")
  parser.add_argument("--steps", default="1,4", help="Steps a call, comma-separated.")
  parser.add_argument("--repeats", type=int, default=11)
  parser.add_argument("--glibc_defaults", action="store_true",
                      help="Leave glibc's malloc settings as they are.")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  kept = False if args.glibc_defaults else launch.keep_freed_memory()

  translator = Translator(args.workdir)
  max_len = args.width + DecodeOptions().max_len_margin
  decoders = {}

  def decoder(count: int) -> slots.SlotDecoder:
    if count not in decoders:
      decoders[count] = slots.SlotDecoder(slot_model(translator.model), translator.params,
                                          count, args.width, max_len, SPECIALS,
                                          beam_size=args.beam_size)
    return decoders[count]

  rows = []
  for active in map(int, args.active.split(",")):
    for steps in map(int, args.steps.split(",")):
      row = {"active": active, "steps": steps}
      for name, count in (("prefix", args.slots), ("whole", active)):
        faults: list[int] = []
        seconds = timed_runs(translator, decoder(count), args.width, steps, args.repeats,
                             active=active, faults=faults)
        row[f"{name}_ms"] = 1e3 * statistics.median(seconds)
        row[f"{name}_faults"] = statistics.median(faults)
        row[f"{name}_runs_ms"] = [round(1e3 * s, 2) for s in seconds]
      rows.append(row)
      print(f"{active:3d} searches, {steps} steps: in {args.slots} slots "
            f"{row['prefix_ms']:7.2f} ms ({row['prefix_faults']:.0f} faults), in {active} "
            f"slots {row['whole_ms']:7.2f} ms ({row['whole_faults']:.0f} faults)", flush=True)
  header = {"cpu": cpu_model(), "jax": jax.__version__, "workdir": Path(args.workdir).name,
            "beam_size": args.beam_size, "width": args.width, "max_len": max_len,
            "slots": args.slots, "freed_memory_kept": kept, "date": time.strftime("%Y-%m-%d"),
            "command": sys.argv}
  if args.json:
    Path(args.json).write_text(json.dumps({**header, "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
