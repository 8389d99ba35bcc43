"""The targets `aot` compiles for without their hardware: TPU topologies and GPU target specs,
each chip's memory and peak, and the compiler plugins a TPU or GPU host would have (libtpu,
jax's CUDA plugin, cuDNN). They are looked for in the Python path and in the directory
`--plugins` (default $TRANSFORMER_JAX_AOT_PLUGINS, else ~/.cache/transformer_jax/aot-plugins),
where `python -m transformer_jax aot --install_plugins` puts the versions pinned for this
jaxlib: kept apart from the environment, they do not slow or clutter every other jax process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path

from transformer_jax import errors
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
    errors.stderr_elsewhere.append(saved)  # Ctrl-C meanwhile: its line goes to the real one.
    try:
      yield
    finally:
      errors.stderr_elsewhere.remove(saved)
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
