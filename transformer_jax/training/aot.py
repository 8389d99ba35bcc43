"""Compiles train.py's programs ahead of time for a named TPU topology or GPU target, on a host
that has neither, and reports what they need of each chip.

  python -m transformer_jax aot --config configs/wmt14_base.py --topology v5e:2x4
  python -m transformer_jax aot --config configs/wmt14_big.py --topology h100:8 \\
      --config.run.mesh_shape="(2,4,1)" --json OUT/big_h100.json

The programs are the ones train.py runs, built by the same library calls: the train state's
shapes and shardings (`step_lib.abstract_train_state`), the jitted train and eval steps with
their donation and step config (`step_lib.jit_steps`), and the beam-search decoder of
translate. No device, no data and no tokenizer is needed: the vocabulary is the config's
`vocab_size` (the joint SentencePiece model has exactly that many pieces).

Per program and device it reports arguments, outputs, temporaries and their total against the
chip's memory, with a verdict; the FLOPs XLA counts against the analytic count of
`flops.model_flops`; and the collectives of the compiled program (kind, count, bytes). The exit
status is 0 when every program fits, 3 when one does not, 1 on bad input.

The compilers come from plugins that a TPU or GPU host would have: libtpu, and jax's CUDA
plugin. They are looked for in the Python path and in the directory `--plugins` (default
$TRANSFORMER_JAX_AOT_PLUGINS, else ~/.cache/transformer_jax/aot-plugins), where
`python -m transformer_jax aot --install_plugins` puts the versions pinned for this jaxlib:
kept apart from the environment, they do not slow or clutter every other jax process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path

from transformer_jax import fs
from transformer_jax.training import hlo as hlo_lib
from transformer_jax.errors import UserError

PLUGINS_ENV = "TRANSFORMER_JAX_AOT_PLUGINS"
DEFAULT_PLUGINS = Path.home() / ".cache" / "transformer_jax" / "aot-plugins"
# The compiler plugins that match each jaxlib release (a plugin of another release refuses to
# load, or miscompiles).
PINNED_PLUGINS = {
    "0.10.2": {"tpu": ["libtpu==0.0.42.1"],
               "gpu": ["jax-cuda12-plugin==0.10.2", "jax-cuda12-pjrt==0.10.2"],
               # cuDNN's library, which jax asks for its version while tracing its fused
               # attention and XLA calls to build the kernel's graph (a 0.7 GB wheel: apart).
               "cudnn": ["nvidia-cudnn-cu12==9.28.0.42"]},
}

GIB = 2 ** 30
# Per chip: HBM bytes and dense bfloat16 peak FLOP/s (vendor data sheets). TPU topology names
# are jax's ("v5e:2x4"); GPU targets read their memory from the target spec.
TPU_CHIPS = {"v4": (32 * GIB, 275e12), "v5e": (16 * GIB, 197e12), "v5p": (95 * GIB, 459e12),
             "v6e": (32 * GIB, 918e12)}
GPU_CHIPS = {"h100": ("h100_sxm.txtpb", "h100", 989e12), "a100": ("a100_sxm_80.txtpb", "a100",
                                                                   312e12)}
SPECS = Path(__file__).resolve().parent / "gpu_specs"
PROGRAMS = ("train", "eval", "decode")


class AotError(UserError, ValueError):
  """A topology, mesh, batch or installation the compile cannot go on with."""


def prepare_environment() -> None:
  """Before jax starts: the host runs on its CPU (the TPU and GPU compilers are reached only
  through the topology API), and libtpu does not look for a TPU VM's metadata server."""
  for key, value in (("TF_CPP_MIN_LOG_LEVEL", "2"), ("JAX_PLATFORMS", "cpu"),
                     ("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                     ("TPU_ACCELERATOR_TYPE", "v5litepod-8"),
                     # Compile-only: no chip is opened, so compiles may run side by side.
                     ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(key, value)


# What the CUDA plugin's libraries print from C++ as they load on a host without CUDA (three
# times, before any output of the command): they say nothing about the compile.
_PLUGIN_LOAD_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


@contextlib.contextmanager
def plugin_load_noise_dropped():
  """Runs the block with the process's stderr (file descriptor 2, which native code writes to)
  captured, then writes what was captured back, less `_PLUGIN_LOAD_NOISE`'s lines."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode("utf-8", "replace").splitlines(keepends=True):
        if not any(noise in line for noise in _PLUGIN_LOAD_NOISE):
          sys.stderr.write(line)
      sys.stderr.flush()


def plugins_dir(flag: str | None = None) -> Path:
  return Path(flag or os.environ.get(PLUGINS_ENV) or DEFAULT_PLUGINS)


def use_plugins(directory: Path) -> None:
  """Puts the plugin directory on the import path (jax finds `jax_plugins.*` and `libtpu`
  there when it first looks for backends)."""
  if directory.is_dir() and str(directory) not in sys.path:
    sys.path.insert(0, str(directory))


def install_command(platform: str, directory: Path) -> str:
  import jaxlib
  pins = PINNED_PLUGINS.get(jaxlib.__version__)
  if pins is None:
    raise AotError(f"no compiler plugins are pinned for jaxlib {jaxlib.__version__} (known: "
                   f"{sorted(PINNED_PLUGINS)}); add them to PINNED_PLUGINS in {__file__}")
  packages = pins["tpu"] + pins["gpu"] if platform == "all" else pins[platform]
  return (f"{sys.executable} -m pip install --no-deps --target {directory} "
          + " ".join(packages))


def cudnn_found() -> bool:
  """Whether jax finds cuDNN's library (in the plugin directory or the environment): what
  tracing and compiling its fused attention for a GPU target needs on this host."""
  from jax._src.cudnn import fused_attention_stablehlo  # jax's own check, used while tracing.
  try:
    fused_attention_stablehlo.check_cudnn_version()
  except RuntimeError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class Target:
  """A named TPU topology or GPU target: `v5e:2x4`, `v4:2x2x2`, `h100:8`, `h100:2x8`."""
  name: str
  platform: str  # "tpu" or "gpu"
  chip: str
  hbm_bytes: int
  peak_flops: float
  num_slices: int = 1

  @staticmethod
  def parse(name: str, num_slices: int = 1) -> "Target":
    chip, _, shape = name.partition(":")
    chip = chip.lower()
    if chip in TPU_CHIPS and re.fullmatch(r"\d+(x\d+){1,2}", shape):
      hbm, peak = TPU_CHIPS[chip]
      return Target(name, "tpu", chip, hbm, peak, num_slices)
    if chip == "cpu" and re.fullmatch(r"\d+", shape):  # This host's CPU devices.
      return Target(name, "cpu", "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    0.0)
    if chip in GPU_CHIPS and re.fullmatch(r"\d+(x\d+)?", shape):
      spec, _, peak = GPU_CHIPS[chip]
      memory = re.search(r"device_memory_size:\s*(\d+)", (SPECS / spec).read_text())
      return Target(name, "gpu", chip, int(memory.group(1)), peak, num_slices)
    raise AotError(
        f"--topology {name!r} is not a known target: a TPU topology "
        f"({', '.join(sorted(TPU_CHIPS))} with a chip grid, e.g. v5e:2x4, v4:2x2x2) or a GPU "
        f"target ({', '.join(sorted(GPU_CHIPS))} with a GPU count, hosts x GPUs, e.g. h100:8, "
        "h100:2x8)")

  def devices(self) -> list:
    """The target's compile-only devices."""
    from jax.experimental import topologies
    if self.platform == "cpu":
      import jax
      count, available = int(self.name.partition(":")[2]), jax.devices("cpu")
      if count > len(available):
        raise AotError(f"--topology {self.name}: this host has {len(available)} CPU devices "
                       "(XLA_FLAGS=--xla_force_host_platform_device_count=N makes more)")
      return available[:count]
    try:
      if self.platform == "tpu":
        # A v4 chip has two TensorCores; "megacore" makes them one device, as jax runs v4.
        extra = {"chip_config_name": "megacore"} if self.chip == "v4" else {}
        topology = topologies.get_topology_desc(topology_name=self.name, platform="tpu",
                                                num_slices=self.num_slices, **extra)
      else:
        spec_file, xla_name, _ = GPU_CHIPS[self.chip]
        hosts, _, per_host = self.name.partition(":")[2].rpartition("x")
        topology = topologies.get_topology_desc(
            topology_name=xla_name, platform="cuda", target_config=(SPECS / spec_file).read_text(),
            topology=f"1x{hosts or 1}x{per_host}")
    except Exception as e:  # jax/XLA raise several kinds; each means the same to the user.
      text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      missing = ("TPU support not installed", "topology not implemented for cuda",
                 "Unknown backend")
      if any(s in text for s in missing):
        raise AotError(f"compiling for {self.name} needs the {self.platform.upper()} compiler "
                       f"plugin ({text}); install it with: "
                       f"{install_command(self.platform, plugins_dir())}") from None
      raise AotError(f"--topology {self.name}: {text}") from None
    return list(topology.devices)


def _abstract_batch(rows: int, max_len: int, mesh, documents: bool = False):
  """A batch's shapes: sentence pairs, or a language model's documents (`documents`)."""
  import jax
  import jax.numpy as jnp
  from transformer_jax import sharding
  from transformer_jax.data.packing import FEATURES, LM_FEATURES
  spec = jax.ShapeDtypeStruct((rows, max_len), jnp.int32, sharding=sharding.batch_sharding(mesh))
  return {k: spec for k in (LM_FEATURES if documents else FEATURES)}


def _per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings."""
  import jax
  import numpy as np
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize
  return total


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
    arrays = [(dt, dims) for dt, dims in hlo_lib.ARRAY.findall(result_type)
              if dt in hlo_lib.DTYPE_BYTES]
    if start and kind in ("all-gather", "collective-permute") and len(arrays) >= 2:
      arrays = arrays[len(arrays) // 2:]  # (operands, results): the results.
    size = 0
    for dt, dims in arrays:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * hlo_lib.DTYPE_BYTES[dt]
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
      key = ", ".join(f"{dt}[{dims}]" for dt, dims in hlo_lib.ARRAY.findall(match.group(1))
                      if dt in hlo_lib.DTYPE_BYTES)
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


def _table_shapes(params) -> list[tuple[int, int]]:
  """The per-device shapes of the embedding tables (parameters named `embedding`)."""
  import jax
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if getattr(path[-1], "key", None) == "embedding":
      out.append(tuple(x.sharding.shard_shape(x.shape)))
  return out


def _compiler_options(target: Target) -> dict:
  """XLA options of a compile for `target` on this host. For GPUs: XLA would sort large
  arrays (the sorted embedding gradient's) with CUB, whose scratch size it asks of the CUDA
  runtime, absent here; its own sort kernel compiles without one (what runs is otherwise the
  same program)."""
  return {"xla_gpu_enable_cub_radix_sort": False} if target.platform == "gpu" else {}


def _memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  mem = {f: int(getattr(m, f, 0) or 0) for f in fields}
  # Donated arguments alias outputs: their bytes are counted once.
  mem["total_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
                        - mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"])
  return mem


def _xla_flops(compiled) -> float | None:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  flops = cost.get("flops") if cost else None
  return float(flops) if flops and flops > 0 else None


_OOM = re.compile(r"(Ran out of memory|RESOURCE_EXHAUSTED)")


def compile_report(config, target: Target, programs=PROGRAMS, beam_size: int = 4,
                   progress=print, save_train_step: str | None = None,
                   hlo_dir: str | None = None) -> dict:
  """Compiles `programs` of `config` for `target`; returns the report (JSON-ready).
  `save_train_step`: also write the compiled train step there (see load_train_step);
  `hlo_dir`: write each program's optimized HLO there as PROGRAM.hlo.txt."""
  import jax
  import numpy as np
  from transformer_jax import config as config_lib, sharding
  from transformer_jax.models import build, flops as flops_lib
  from transformer_jax.training import checks, steps as step_lib
  cfg = checks.validated(config)
  data = cfg.data
  devices = target.devices()
  try:
    mesh = checks.checked_mesh(cfg, devices)
  except config_lib.ConfigError as e:
    raise AotError(f"{target.name} ({len(devices)} devices): {e}") from None
  vocab = data.vocab_size
  model_cfg = build.model_config(cfg.model, vocab, vocab, platform=target.platform,
                                    max_len=data.max_len)
  documents = model_cfg.family == "decoder_only"
  if model_cfg.attention_impl == "cudnn" and target.platform == "gpu" and not cudnn_found():
    raise AotError(
        f"cuDNN's fused attention (model.attention_impl={cfg.model.attention_impl!r}: "
        f"{model_cfg.dtype} on a GPU) needs cuDNN's library to compile; install it with: "
        f"{install_command('cudnn', plugins_dir())} (or compile XLA's attention: "
        "--config.model.attention_impl=xla)")
  model = build.build_model(model_cfg)
  tx = step_lib.make_optimizer(cfg.optimizer, cfg.run.num_steps)
  state, state_shardings = step_lib.abstract_train_state(
      model, tx, mesh, data.max_len, ema=cfg.step.ema_decay > 0)
  p_train, p_eval = step_lib.jit_steps(state_shardings, mesh, cfg.step)
  n = len(devices)
  report = {
      "target": target.name, "platform": target.platform, "chip": target.chip,
      "num_devices": n, "num_slices": target.num_slices,
      "hbm_bytes_per_device": target.hbm_bytes,
      "mesh": dict(zip(sharding.MESH_AXES, (int(s) for s in mesh.devices.shape))),
      "batch_size": data.batch_size, "max_len": data.max_len,
      "grad_accum_steps": cfg.step.grad_accum_steps, "loss_chunks": cfg.step.loss_chunks,
      "vocab_size": vocab, "dtype": model_cfg.dtype, "attention_impl": model_cfg.attention_impl,
      "embed_grad": model_cfg.embed_grad, "compiler_options": _compiler_options(target),
      "scan_layers": model_cfg.scan_layers, "remat": model_cfg.remat,
      "params_bytes_per_device": _per_device_bytes(state.params),
      "opt_state_bytes_per_device": _per_device_bytes(state.opt_state),
      "jax": jax.__version__, "programs": {},
  }
  full = lambda rows: np.full(rows, data.max_len)  # Every row one sentence of max_len.

  def lowered(name):
    with sharding.mesh_context(mesh):
      if name == "train":
        return p_train.lower(state, _abstract_batch(data.batch_size, data.max_len, mesh,
                                                    documents))
      if name == "eval":
        return p_eval.lower(state, _abstract_batch(cfg.eval.batch_size, data.max_len, mesh,
                                                   documents))
      return _decoder(model, state_shardings.params, mesh, data.max_len, beam_size,
                      target.platform).lower(
          state.params, _abstract_batch(cfg.eval.batch_size, data.max_len, mesh)["inputs"])

  analytic = {"train": flops_lib.model_flops(model_cfg, full(data.batch_size),
                                             full(data.batch_size)),
              "eval": flops_lib.model_flops(model_cfg, full(cfg.eval.batch_size),
                                            full(cfg.eval.batch_size)) / 3.0,
              "decode": None}  # Beam search's count depends on when beams finish.
  if documents and "decode" in programs:  # `decode` is translate's encoder-decoder search.
    programs = [p for p in programs if p != "decode"]
    report["not_compiled"] = {"decode": "translate's decoder (encoder-decoder models only)"}
  for name in programs:
    progress(f"compiling {name} for {target.name} ...")
    start = time.perf_counter()
    entry = {}
    try:
      program = lowered(name)
      compiled = program.compile(compiler_options=_compiler_options(target))
      if name == "train" and save_train_step:
        _save_executable(compiled, program, target, n, save_train_step)
    except Exception as e:  # XLA raises XlaRuntimeError (or ValueError) with the status text.
      text = str(e)
      if not _OOM.search(text):
        raise
      entry.update(fits=False, error=" ".join(text.split())[:500])
    else:
      entry.update(_memory(compiled))
      entry["fits"] = entry["total_bytes"] <= target.hbm_bytes
      entry["xla_flops_per_device"] = _xla_flops(compiled)
      hlo = compiled.as_text()
      entry["collectives"] = collectives(hlo)
      entry["scatters"] = scatters(hlo)
      entry["custom_calls"] = custom_calls(hlo)
      entry["while_loops"] = while_loops(hlo)
      entry["embedding_scatters"] = embedding_scatters(entry["scatters"],
                                                       _table_shapes(state.params))
      if name in ("train", "eval"):
        rows = data.batch_size if name == "train" else cfg.eval.batch_size
        layers = tuple({model_cfg.num_encoder_layers, model_cfg.num_decoder_layers} - {0})
        entry["step_shape"] = hlo_lib.step_shape(hlo, hlo_lib.Dims(
            rows // (mesh.shape["data"] * mesh.shape["fsdp"]), data.max_len,
            model_cfg.tgt_vocab_size, layers))
      if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        fs.replace_file(Path(hlo_dir) / f"{name}.hlo.txt", hlo.encode())
    entry["compile_seconds"] = round(time.perf_counter() - start, 1)
    if analytic[name] is not None:
      entry["analytic_flops_per_device"] = analytic[name] / n
      if entry.get("xla_flops_per_device"):
        entry["xla_over_analytic"] = entry["xla_flops_per_device"] / entry[
            "analytic_flops_per_device"]
    report["programs"][name] = entry
  report["fits"] = all(p["fits"] for p in report["programs"].values())
  return report


_FORMAT = 1


def _program_digest(lowered) -> str:
  """What must be equal for a saved executable to stand in for a jitted step: its program."""
  return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _save_executable(compiled, lowered, target: Target, num_devices: int, path: str) -> None:
  """Writes a compiled train step with what load_train_step checks (whole, or not at all)."""
  import jax
  from jax.experimental import serialize_executable
  payload, _, _ = serialize_executable.serialize(compiled)
  blob = {"format": _FORMAT, "jax": jax.__version__, "platform": target.platform,
          "target": target.name, "num_devices": num_devices,
          "program_sha256": _program_digest(lowered), "executable": payload}
  fs.replace_file(path, pickle.dumps(blob))


def load_train_step(path: str | Path, p_train, state, mesh, batch_size: int, max_len: int):
  """The train step compiled ahead of time and saved at `path` (`--save_train_step`), loaded in
  place of `p_train` (step_lib.jit_steps's), which it must equal: the same program (config,
  shardings, mesh, jax) for this host's platform and device count.

  Raises:
    AotError: the file cannot be read, or holds another program or another target's.
  """
  import jax
  from jax.experimental import serialize_executable
  from transformer_jax import sharding
  path = Path(path)
  try:
    blob = pickle.loads(path.read_bytes())
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
      raise ValueError("not a saved train step")
  except (OSError, pickle.UnpicklingError, ValueError, EOFError) as e:
    raise AotError(f"compiled_train_step {path} cannot be read ({e})") from None
  here = (jax.__version__, jax.default_backend(), mesh.size)
  saved = (blob["jax"], blob["platform"], blob["num_devices"])
  if here != saved:
    raise AotError(f"compiled_train_step {path} was compiled for {blob['target']} with jax "
                   f"{blob['jax']} ({blob['num_devices']} {blob['platform']} devices); this run "
                   f"has jax {here[0]} and {here[2]} {here[1]} devices")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  with sharding.mesh_context(mesh):
    lowered = p_train.lower(abstract, _abstract_batch(batch_size, max_len, mesh))
  if _program_digest(lowered) != blob["program_sha256"]:
    raise AotError(f"compiled_train_step {path} holds another program than this run's train "
                   "step (the config, mesh or code differ): compile it again for this config")
  return serialize_executable.deserialize_and_load(blob["executable"], lowered.in_tree,
                                                   lowered.out_tree)


def _decoder(model, param_shardings, mesh, max_len: int, beam_size: int, platform: str):
  """translate's decoder (generation.generate) jitted over `mesh`: source rows split over the
  data-parallel devices, parameters placed as in training, beams' rows copied as on
  `platform` (decoding/platforms.py)."""
  import jax
  from transformer_jax import sharding
  from transformer_jax.decoding import platforms
  from transformer_jax.decoding.generation import generate
  return jax.jit(functools.partial(generate, model, max_len=max_len + 10, beam_size=beam_size,
                                   row_copy=platforms.settings(platform).row_copy),
                 in_shardings=(param_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.batch_sharding(mesh))


def _size(n: int) -> str:
  return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.2f} MiB"


def format_report(report: dict) -> str:
  """The report as a few lines of text."""
  mesh = "x".join(str(v) for v in report["mesh"].values())
  lines = [f"{report['target']}: {report['num_devices']} x {report['chip']} "
           f"({_size(report['hbm_bytes_per_device'])} each), mesh data x fsdp x tensor = "
           f"{mesh}, batch {report['batch_size']} x {report['max_len']}, {report['dtype']}, "
           f"attention {report['attention_impl']}, embedding gradient {report['embed_grad']}",
           f"  per device: parameters {_size(report['params_bytes_per_device'])}, optimizer "
           f"state {_size(report['opt_state_bytes_per_device'])}"]
  for name, p in report["programs"].items():
    if "error" in p:
      lines.append(f"  {name}: DOES NOT FIT: {p['error'][:300]}")
      continue
    verdict = ("fits" if p["fits"] else
               f"DOES NOT FIT by {_size(p['total_bytes'] - report['hbm_bytes_per_device'])}")
    flops = ""
    if p.get("xla_flops_per_device"):
      flops = f"; XLA {p['xla_flops_per_device'] / 1e9:,.2f} GFLOP/device"
      if p.get("analytic_flops_per_device"):
        flops += (f" vs analytic {p['analytic_flops_per_device'] / 1e9:,.2f} "
                  f"({p['xla_over_analytic']:.3f}x)")
    elif p.get("analytic_flops_per_device"):
      flops = (f"; analytic {p['analytic_flops_per_device'] / 1e9:,.2f} GFLOP/device "
               "(XLA gives no count for this target)")
    coll = ", ".join(f"{k} {v['count']} ({_size(v['bytes'])})"
                     for k, v in sorted(p["collectives"].items())) or "none"
    lines.append(f"  {name}: args {_size(p['argument_size_in_bytes'])} + outputs "
                 f"{_size(p['output_size_in_bytes'])} - aliased {_size(p['alias_size_in_bytes'])}"
                 f" + temps {_size(p['temp_size_in_bytes'])} = {_size(p['total_bytes'])}: "
                 f"{verdict}{flops}; collectives: {coll}; scatters into an embedding table: "
                 f"{p['embedding_scatters']}; compiled in {p['compile_seconds']} s")
    if "step_shape" in p:
      lines.extend(hlo_lib.format_shape(p["step_shape"]))
  for name, why in report.get("not_compiled", {}).items():
    lines.append(f"  {name}: not compiled: {why}")
  return "\n".join(lines)
