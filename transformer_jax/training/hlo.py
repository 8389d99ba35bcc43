"""What a compiled program holds, read from its optimized HLO text: its collectives, scatters,
custom calls and while loops (`aot`'s report), and the shape of a train step: what launches (fusions
and custom calls, per pass of a scanned layer loop), which [tokens, vocab] arrays are written to
memory, and how the attention is masked. `aot` prints it for every target, so that a change
that adds a pass over the activations, a float32 copy of the logits or a dense mask is seen
without the hardware (tests pin it at the smoke size).

Only instructions of unfused computations count: what a fusion computes inside itself stays
in registers or shared memory; what an unfused instruction produces is an array in memory (a
bitcast, tuple, get-tuple-element or parameter names one, and is not counted again).
"""

from __future__ import annotations

import dataclasses
import re

# Bytes an element of each HLO element type takes; an array type such as `bf16[64,1024]`.
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# `%name (params) -> result {` or `ENTRY %name ...{`: a computation's first line.
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
# `  [ROOT] %name = TYPE opcode(`: an instruction, its result type and opcode.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\S+?|\(.*?\))\s+([a-z][\w\-]*)\(")
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_BODY = re.compile(r"body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_MASK_TYPE = re.compile(r'\\?"mask_type\\?":\s*\\?"(\w+)')
# Instructions that name an array another one produced, or hold no data of their own.
_ALIASES = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "copy-start",
            "copy-done", "opt-barrier"}


@dataclasses.dataclass(frozen=True)
class Dims:
  """The sizes the report looks for: a step's rows and length, and the padded vocabulary."""
  rows: int
  length: int
  vocab: int
  layer_counts: tuple[int, ...]  # The trip counts of scanned layer loops (each stack's depth).


def _computations(text: str) -> dict[str, list[str]]:
  out, name = {}, None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      name = match.group(1)
      out[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      out[name].append(line)
  return out


def _arrays(result_type: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in ARRAY.findall(result_type) if dt in DTYPE_BYTES]


def _count(lines: list[str]) -> dict:
  """Fusions and custom calls (by target) among `lines`' instructions."""
  fusions, calls = 0, {}
  for line in lines:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    if match.group(2) == "fusion":
      fusions += 1
    elif match.group(2) == "custom-call":
      target = _TARGET.search(line)
      key = target.group(1) if target else "?"
      calls[key] = calls.get(key, 0) + 1
  return {"fusions": fusions, "custom_calls": calls}


def step_shape(text: str, dims: Dims) -> dict:
  """The report of an optimized HLO module (JSON-ready):

  fusions, custom_calls: in the whole module (a loop body counted once);
  layer_loops: for each while loop that runs as many times as a stack has layers (a scanned
    stack's forward and backward passes), its body's fusions and custom calls: what one layer
    launches;
  vocab_arrays: {"dtype[dims]": {"count", "bytes"}} of the arrays in memory that hold a value
    per token and vocabulary entry (at least rows x length x vocab elements);
  mask_arrays: the same for [rows, 1, length, length] arrays (a mask or bias over all heads);
  attention: cuDNN's fused attention calls by target, how many take a bias operand, and their
    mask types ("NO_MASK" with a bias: the mask was made dense).
  """
  computations = _computations(text)
  fused = {c for lines in computations.values() for line in lines
           if " fusion(" in line for c in _CALLS.findall(line)}
  unfused = {name: lines for name, lines in computations.items() if name not in fused}
  total = _count([line for lines in unfused.values() for line in lines])
  loops = []
  for lines in unfused.values():
    for line in lines:
      if " while(" not in line:
        continue
      trip, body = _TRIP.search(line), _BODY.search(line)
      if trip and body and int(trip.group(1)) in dims.layer_counts and body.group(1) in unfused:
        loops.append({"trip_count": int(trip.group(1)), **_count(unfused[body.group(1)])})
  vocab_arrays, mask_arrays = {}, {}
  tokens = dims.rows * dims.length
  mask_shapes = {(dims.rows, 1, dims.length, dims.length)}
  attention = {"calls": {}, "with_bias": 0, "mask_types": {}}
  for lines in unfused.values():
    for line in lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      result_type, opcode = match.groups()
      if opcode == "custom-call":
        target = _TARGET.search(line)
        if target and "fmha" in target.group(1):
          name = target.group(1)
          attention["calls"][name] = attention["calls"].get(name, 0) + 1
          attention["with_bias"] += "Bias" in name
          mask = _MASK_TYPE.search(line)
          if mask:
            attention["mask_types"][mask.group(1)] = attention["mask_types"].get(
                mask.group(1), 0) + 1
      if opcode in _ALIASES:
        continue
      for dtype, shape in _arrays(result_type):
        n = 1
        for d in shape:
          n *= d
        key = f"{dtype}[{','.join(map(str, shape))}]"
        into = (vocab_arrays if dims.vocab in shape and n >= tokens * dims.vocab else
                mask_arrays if shape in mask_shapes else None)
        if into is not None:
          entry = into.setdefault(key, {"count": 0, "bytes": 0})
          entry["count"] += 1
          entry["bytes"] += n * DTYPE_BYTES[dtype]
  return {**total, "layer_loops": loops, "vocab_arrays": vocab_arrays,
          "mask_arrays": mask_arrays, "attention": attention}


def format_shape(shape: dict) -> list[str]:
  """The report in a few indented lines."""
  calls = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"
  arrays = lambda a: ", ".join(f"{k} x{v['count']} ({v['bytes'] / 2 ** 20:,.1f} MiB)"
                               for k, v in sorted(a.items())) or "none"
  lines = [f"    kernels: {shape['fusions']} fusions; custom calls: {calls(shape['custom_calls'])}"]
  for i, loop in enumerate(shape["layer_loops"]):
    lines.append(f"    layer loop {i + 1} (x{loop['trip_count']}): {loop['fusions']} fusions a "
                 f"layer; custom calls: {calls(loop['custom_calls'])}")
  att = shape["attention"]
  if att["calls"]:
    lines.append(f"    cuDNN attention: {calls(att['calls'])}; with a bias operand: "
                 f"{att['with_bias']}; mask types: {calls(att['mask_types'])}")
  lines.append(f"    [tokens, vocab] arrays in memory: {arrays(shape['vocab_arrays'])}")
  lines.append(f"    [rows, 1, length, length] mask arrays in memory: "
               f"{arrays(shape['mask_arrays'])}")
  return lines


# Counts over a whole optimized module, for aot's report.

_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast)(-start)?\(")


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {"count", "bytes"}} of the collectives in an optimized HLO module, bytes being each
  one's result (for an async start, the arrays it produces). An op inside a loop body (a
  scanned layer stack, gradient accumulation) is counted once, not once per iteration."""
  out: dict[str, dict[str, int]] = {}
  for line in hlo_text.splitlines():
    match = _COLLECTIVE.search(line)
    if not match:
      continue
    result_type, kind, start = match.groups()
    arrays = [(dt, dims) for dt, dims in ARRAY.findall(result_type)
              if dt in DTYPE_BYTES]
    if start and kind in ("all-gather", "collective-permute") and len(arrays) >= 2:
      arrays = arrays[len(arrays) // 2:]  # (operands, results): the results.
    size = 0
    for dt, dims in arrays:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * DTYPE_BYTES[dt]
    entry = out.setdefault(kind, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size
  return out


_SCATTER = re.compile(r"=\s*(.+?)\s+scatter\(")


def scatters(hlo_text: str) -> dict[str, int]:
  """{result type: count} of the scatter ops in an optimized HLO module (those inside fused
  computations included), e.g. {"f32[512,32]": 2}; a variadic scatter's types joined by ", "."""
  out: dict[str, int] = {}
  for line in hlo_text.splitlines():
    match = _SCATTER.search(line)
    if match:
      key = ", ".join(f"{dt}[{dims}]" for dt, dims in ARRAY.findall(match.group(1))
                      if dt in DTYPE_BYTES)
      out[key] = out.get(key, 0) + 1
  return out


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def custom_calls(hlo_text: str) -> dict[str, int]:
  """{target: count} of the custom calls in an optimized HLO module: the kernels XLA did not
  generate itself (`tpu_custom_call`: a Pallas kernel such as splash attention on TPUs;
  `__cudnn$fmha...`: cuDNN's fused attention)."""
  out: dict[str, int] = {}
  for target in _CUSTOM_CALL.findall(hlo_text):
    out[target] = out.get(target, 0) + 1
  return out


_WHILE = re.compile(r"\swhile\(")


def while_loops(hlo_text: str) -> int:
  """The while loops of an optimized HLO module (nested ones included). On a GPU each pass of
  a loop is its own launches: the decoder's search is one loop; a loop per beam step over the
  cache rows that moved (a CPU's copy, decoding/platforms.py) would be more."""
  return len(_WHILE.findall(hlo_text))


def embedding_scatters(scatter_counts: dict[str, int], table_shapes) -> int:
  """Of `scatters`' counts, those whose result has the shape of an embedding table as one
  device holds it (`table_shapes`: (rows, columns) pairs): the gradient of a lookup formed by
  scatter-add, which on GPUs adds with contended atomics."""
  shapes = {f"{r},{c}" for r, c in table_shapes}
  return sum(count for key, count in scatter_counts.items()
             for part in key.split(", ") if part[part.index("[") + 1:-1] in shapes)
