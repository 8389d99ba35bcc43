"""Where one batch's decoding time goes, op by op: jax's profiler traces the jitted decoder
(`generation.beams`, or greedy with beam 1) on real sources, and each compiled op's time is
credited to the model code it came from (the HLO's op_name metadata, shortened to the part
under the decoding loop). Usage:
  python benchmarks/analysis/decode_op_profile.py WORKDIR INPUT [BATCH BEAMS WIDTH [TOP]]
Takes the first BATCH lines of INPUT whose tokens (with <eos>) round up to WIDTH (a multiple
of 8, as translate batches them), decodes them to WIDTH + 10 tokens at the workdir's alpha
and prints, for the TOP most costly sources (default 25), milliseconds per call of the whole
decoder and the share of the traced time."""

import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import sources_of_width  # noqa: E402
from transformer_jax import generation  # noqa: E402
from transformer_jax.commands.translate import read_lines  # noqa: E402
from transformer_jax.translator import Translator  # noqa: E402

workdir, path = sys.argv[1], sys.argv[2]
batch, beams, width = (int(x) for x in sys.argv[3:6]) if len(sys.argv) > 5 else (64, 4, 16)
top = int(sys.argv[6]) if len(sys.argv) > 6 else 25
translator = Translator(workdir)
lines, src = sources_of_width(translator, read_lines(path), width, batch)
if len(lines) < batch:
  sys.exit(f"{path} has {len(lines)} lines of width {width}, fewer than {batch}")
alpha = translator.config.decode.alpha
decoder = jax.jit(lambda params, src: generation.scored(
    translator.model, params, src, width + 10, beams, alpha))
jax.block_until_ready(decoder(translator.params, src))  # Compiled before the trace.

# Each compiled op's source: its op_name, without the jit and loop prefixes.
hlo = decoder.lower(translator.params, src).compile().as_text()
source = {}
for name, op_name in re.findall(r"%([\w.-]+) = .*?op_name=\"([^\"]+)\"", hlo):
  op_name = re.sub(r"^jit\([^)]*\)/", "", op_name)
  op_name = re.sub(r"(while/body/|closed_call/|jit\((\w+)\)/|Transformer\.|decoder_stack\.step/|"
                   r"_sublayer/\w+|\.attend_heads|/dot_general)", "", op_name)
  source[name] = re.sub(r"(decoder_\d)\.step/(decoder_\d\.)?", r"\1.", op_name)

calls = 3
with tempfile.TemporaryDirectory() as trace_dir:
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      jax.block_until_ready(decoder(translator.params, src))
  trace = json.load(gzip.open(next(Path(trace_dir).rglob("*.json.gz"))))
events = trace["traceEvents"] if isinstance(trace, dict) else trace
per_source = collections.Counter()
for event in events:
  if event.get("ph") == "X" and event["name"] in source:
    per_source[source[event["name"]]] += event["dur"] / 1e3 / calls
total = sum(per_source.values())
print(f"{batch} sources of width {width}, beam {beams}, alpha {alpha}: {total:.1f} ms of "
      f"compiled ops per call ({jax.devices()[0].device_kind}, {jax.__version__})")
for name, ms in per_source.most_common(top):
  print(f"{ms:8.2f} ms {ms / total:6.1%}  {name}")


def part(name: str) -> str:
  """The part of decoding a source belongs to."""
  if name.startswith(("encode", "source_state")):
    return "encoder and cross-attention keys/values (once a batch)"
  if not name.startswith("decode_step"):
    return "search: choosing tokens, reordering beams and caches, loop"
  if "_logits" in name:
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
