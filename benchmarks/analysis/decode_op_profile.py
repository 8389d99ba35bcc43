"""Where decoding's time goes, op by op: jax's profiler traces a jitted decoder on real sources,
and each compiled op's time is credited to the model code it came from (the HLO's op_name
metadata, shortened to the part under the decoding loop). Usage:
  python benchmarks/analysis/decode_op_profile.py WORKDIR INPUT [BATCH BEAMS WIDTH [TOP]]
Takes the first BATCH lines of INPUT whose tokens (with <eos>) round up to WIDTH (a multiple
of 8, as translate batches them), decodes them to WIDTH + 10 tokens at the workdir's alpha
and prints, for the TOP most costly sources (default 25), milliseconds per call and the share
of the traced time.

Without `--slots`, one call of the fixed-batch decoder (`generation.scored`) on the BATCH
sources. With `--slots`, one step of the decoding slots (slots.py) with BATCH slots of BEAMS
rows each, every slot holding one of the sources: the run program that steps them all,
`--steps` steps from their first (a step's cost, as benchmarks/analysis/slot_steps.py times
it)."""

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import sources_of_width  # noqa: E402
from transformer_jax.decoding import generation, slots  # noqa: E402
from transformer_jax.commands.translate import read_lines  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("workdir")
parser.add_argument("input")
parser.add_argument("batch", type=int, nargs="?", default=64)
parser.add_argument("beams", type=int, nargs="?", default=4)
parser.add_argument("width", type=int, nargs="?", default=16)
parser.add_argument("top", type=int, nargs="?", default=25)
parser.add_argument("--slots", action="store_true", help="Profile a step of the slots.")
parser.add_argument("--steps", type=int, default=16, help="With --slots: the steps traced.")
args = parser.parse_args()
batch, beams, width = args.batch, args.beams, args.width
translator = Translator(args.workdir)
lines, src = sources_of_width(translator, read_lines(args.input), width, batch)
if len(lines) < batch:
  sys.exit(f"{args.input} has {len(lines)} lines of width {width}, fewer than {batch}")
alpha = translator.config.decode.alpha

if args.slots:
  decoder = slots.SlotDecoder(generation.slot_model(translator.model), translator.params, batch,
                              width, width + 10, generation.SPECIALS, beam_size=beams,
                              alpha=alpha)
  encoded = decoder._encode(decoder.params, src)
  state = decoder._empty(decoder.params)
  every = np.arange(batch, dtype=np.int32)
  # The run program of every slot, stepped `--steps` steps (or until every search ends).
  program = jax.jit(lambda params, state: decoder._run_fn(
      params, state, np.int32(batch + 1), np.int32(args.steps), rows=batch))

  def call():
    """Fills every slot afresh, then times the run (its steps are what the trace credits)."""
    global state
    state = decoder._refill(state, encoded, every, np.full(batch, width + 10, np.int32),
                            every, np.full(batch, alpha, np.float32))
    state, _, steps, _ = program(decoder.params, state)
    return int(steps)

  hlo = program.lower(decoder.params, state).compile().as_text()
  unit = f"step of {batch} slots ({batch * beams} rows)"
else:
  fixed = jax.jit(lambda params, src: generation.scored(
      translator.model, params, src, width + 10, beams, alpha))

  def call():
    jax.block_until_ready(fixed(translator.params, src))
    return 1

  hlo = fixed.lower(translator.params, src).compile().as_text()
  unit = "call"
call()  # Compiled before the trace.

# Each compiled op's source: its op_name, without the jit and loop prefixes (ops XLA made
# without one, such as the attention's batched products of a slots' step: their opcode).
opcodes = dict(re.findall(r"\n\s*(?:ROOT )?%?([\w.-]+) = \S+ ([\w-]+)\(", hlo))
source = {name: f"(no op_name) {opcode}" for name, opcode in opcodes.items()}
for name, op_name in re.findall(r"%([\w.-]+) = .*?op_name=\"([^\"]+)\"", hlo):
  op_name = re.sub(r"^jit\([^)]*\)/", "", op_name)
  op_name = re.sub(r"(while/body/|closed_call/|jit\((\w+)\)/|Transformer\.|decoder_stack\.step/|"
                   r"_sublayer/\w+|\.attend_heads|/dot_general)", "", op_name)
  source[name] = re.sub(r"(decoder_\d)\.step/(decoder_\d\.)?", r"\1.", op_name)

calls, units = 3, 0
with tempfile.TemporaryDirectory() as trace_dir:
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      units += call()
  trace = json.load(gzip.open(next(Path(trace_dir).rglob("*.json.gz"))))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
per_source = collections.Counter()
program_name = re.search(r"HloModule ([\w.-]+)", hlo).group(1)
for event in events:
  if (event.get("ph") == "X" and event["name"] in source
      # A loop's or branch's own event spans its body's ops, which are credited themselves.
      and opcodes.get(event["name"], event["name"].split(".")[0]) not in ("while", "conditional")
      and event.get("args", {}).get("hlo_module", program_name) == program_name):
    per_source[source[event["name"]]] += event["dur"] / 1e3 / units
total = sum(per_source.values())
print(f"{batch} sources of width {width}, beam {beams}, alpha {alpha}: {total:.2f} ms of "
      f"compiled ops per {unit} ({jax.devices()[0].device_kind}, {jax.__version__})")
for name, ms in per_source.most_common(args.top):
  print(f"{ms:8.2f} ms {ms / total:6.1%}  {name}")


def part(name: str) -> str:
  """The part of decoding a source belongs to."""
  if name.startswith("(no op_name)"):
    return f"{name}: made by XLA, credited to no model code"
  if name.startswith(("encode", "source_state")):
    return "encoder and cross-attention keys/values (once a batch)"
  if not name.startswith("decode_step"):
    return "search: choosing tokens, reordering beams and caches, loop"
  if "_logits" in name or "d,vd->" in name:  # The tied projection's einsum.
    return "decoder: vocabulary projection"
  if re.search(r"\.project/|/ffn/|\.output/", name):
    return "decoder: layers' projections and feed-forward"
  if re.search(r"attention/|self_attention/", name):
    return "decoder: attention over cache and source"
  return "decoder: the rest (norms, residuals, embedding, cache writes)"


parts = collections.Counter()
for name, ms in per_source.items():
  parts[part(name)] += ms
print("By part:")
for name, ms in parts.most_common():
  print(f"{ms:8.2f} ms {ms / total:6.1%}  {name}")
