"""The machine a benchmark ran on, as its JSON records it (imports nothing heavy: the load
client uses it too)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def use_cpu_threads(threads: int) -> None:
  """XLA's CPU thread pool of `threads` threads (set before jax starts)."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                             f"{'true' if threads > 1 else 'false'} "
                             f"intra_op_parallelism_threads={threads}").strip()


def cpu_model() -> str:
  """The CPU's model name and its AVX-512 extensions (XLA compiles for the CPU it runs on, so a
  figure holds for one CPU model), e.g. "AMD EPYC 9B14 (avx512f, avx512_bf16)"."""
  try:
    info = Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor() or platform.machine()
  name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
               if line.startswith("model name")), platform.machine())
  flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                if line.startswith("flags")), [])
  extensions = [f for f in flags if f in ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")]
  return f"{name} ({', '.join(extensions)})" if extensions else name
