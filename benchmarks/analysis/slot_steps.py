"""What one decoder step of the slots costs by the rows it computes, and how many rows a second
of decoding computes with 1, 2, ... lanes (streams stepping at once in threads of their own).

  python benchmarks/analysis/slot_steps.py runs/fra_eng --beam_size 4 --slots 1,4,16,32 \
      --lanes 1,2 --json slot_steps.json

The workdir's model and parameters; every slot holds a search of a random source (token ids
drawn uniformly, `--width` tokens), filled again before each timed run of `--steps` steps, so
every step computes all of a run's rows (the searches' outputs do not matter here, only what
their steps cost). The median step of `--repeats` runs per lane and setting.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from transformer_jax.decoding import slots  # noqa: E402
from transformer_jax.decoding.generation import SPECIALS, slot_model  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402


def timed_runs(translator, decoder, width: int, steps: int, repeats: int,
               active: int | None = None, faults: list | None = None) -> list[float]:
  """Seconds of `repeats` runs of `steps` steps in this thread, the first `active` slots busy
  (default: every slot), each run the smallest run size that holds them; one run more first
  (its program's first call). `faults`: where given, each run's minor page faults go there."""
  n = decoder.slots
  active = n if active is None else active
  rng = np.random.default_rng(0)
  src = rng.integers(4, translator.tokenizers.src.vocab_size, (n, width)).astype(np.int32)
  src[:, -1] = SPECIALS.eos
  encoded = decoder._encode(decoder.params, src)
  state = decoder._empty(decoder.params)
  run = decoder._runs[min(size for size in decoder.run_sizes if size >= active)]
  take = np.where(np.arange(n) < active, np.arange(n), -1).astype(np.int32)
  seconds, faulted = [], []
  for _ in range(repeats + 1):
    state = decoder._refill(state, encoded, take, np.full(n, decoder.max_len, np.int32),
                            np.arange(n, dtype=np.int32), np.ones(n, np.float32))
    jax.block_until_ready(state)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    state, _, ran, _ = run(decoder.params, state, np.int32(n + 1), np.int32(steps))
    assert int(ran) == steps, (int(ran), steps)  # Waits for the run (and its state) to end.
    seconds.append(time.perf_counter() - start)
    faulted.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  if faults is not None:
    faults.extend(faulted[1:])
  return seconds[1:]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--beam_size", type=int, default=1)
  parser.add_argument("--slots", default="4,16,64,128", help="Slot counts, comma-separated.")
  parser.add_argument("--lanes", default="1,2", help="Lane counts, comma-separated.")
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  translator = Translator(args.workdir)
  max_len = args.width + 10
  rows = []
  for count in map(int, args.slots.split(",")):
    decoder = slots.SlotDecoder(slot_model(translator.model), translator.params, count,
                                args.width, max_len, SPECIALS, beam_size=args.beam_size)
    for lanes in map(int, args.lanes.split(",")):
      times: list[list[float]] = [[] for _ in range(lanes)]
      timed_runs(translator, decoder, args.width, args.steps, 1)  # Compiled before the lanes start.
      start = time.perf_counter()
      threads = [threading.Thread(target=lambda i=i: times[i].extend(
          timed_runs(translator, decoder, args.width, args.steps, args.repeats)))
                 for i in range(lanes)]
      for thread in threads:
        thread.start()
      for thread in threads:
        thread.join()
      wall = time.perf_counter() - start
      step_ms = 1e3 * statistics.median(t for lane in times for t in lane) / args.steps
      row = {"beam_size": args.beam_size, "slots": count, "rows": count * args.beam_size,
             "lanes": lanes, "step_ms": step_ms,
             "rows_per_s": lanes * args.repeats * args.steps * count * args.beam_size / wall}
      rows.append(row)
      print(f"beam {args.beam_size} slots {count:4d} ({row['rows']:4d} rows) lanes {lanes}: "
            f"{step_ms:6.2f} ms a step, {row['rows_per_s']:8.0f} rows/s", flush=True)
  header = {"cpu": cpu_model(), "jax": jax.__version__, "workdir": Path(args.workdir).name,
            "width": args.width, "max_len": max_len, "steps": args.steps,
            "date": time.strftime("%Y-%m-%d"), "command": sys.argv}
  if args.json:
    Path(args.json).write_text(json.dumps({**header, "rows": rows}, indent=2))


if __name__ == "__main__":
  main()
