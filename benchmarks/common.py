"""What the benchmark scripts share: loading a config file with overrides, round-robin timing."""

from __future__ import annotations

import ast
import importlib.util
import time
from typing import Callable

import jax


def load_config(path: str, overrides: list[str] = ()):
  """`configs/NAME.py[:ARG]` -> its ml_collections config, with `field.sub=value` overrides
  applied (values parsed as Python literals; bare words stay strings). Loads by file path, as
  absl's config_flags does, so that the scripts run without absl flags."""
  name, _, arg = path.partition(":")
  spec = importlib.util.spec_from_file_location("bench_config", name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ValueError(f"override {item!r} is not FIELD=VALUE")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part] if part in node else {}
    if leaf not in node:
      raise ValueError(f"override {item!r}: the config has no field {key!r}")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    node[leaf] = value  # ml_collections refuses a value of another type.
  return config


def interleaved(fns: dict[str, Callable], repeats: int, calls: int = 1) -> dict[str, list]:
  """Times every function `calls` times a round for `repeats` rounds, round-robin (A B A B), so
  that all of them see the same machine load; returns {name: [seconds a call, ...]}. Each runs
  twice first (compilation, warm-up)."""
  for fn in fns.values():
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times[name].append(time.perf_counter() - start)
  return times


def sources_of_width(translator, lines: list[str], width: int, limit: int | None = None):
  """(lines, ids [N, width]): the first `limit` (default: all) non-blank `lines` whose tokens
  with <eos> round up to `width` (a multiple of 8, as translate batches them), and their ids
  for `translator`'s model."""
  from transformer_jax.decoding.generation import encode_sources
  tokenizer = translator.tokenizers.src
  lines = [line for line, ids in zip(lines, tokenizer.encode(lines))
           if line.strip() and -(-(len(ids) + 1) // 8) * 8 == width][:limit]
  return lines, encode_sources(tokenizer, lines, translator.max_src_len, width=width)
