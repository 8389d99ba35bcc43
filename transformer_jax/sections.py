"""The config's fields as the frozen dataclasses of the subsystems that use them.

config.py knows the fields and checks their values and imports no subsystem; each function here
hands one group of them to its subsystem's dataclass (model, data, optimizer, step), and
`checked_mesh` turns `mesh_shape` into a device mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from transformer_jax import config as config_lib, sharding
from transformer_jax.model import TransformerConfig


def validated(config: ml_collections.ConfigDict) -> None:
  """config.validate, and the dataset's name against the registered builders."""
  config_lib.validate(config)
  from transformer_jax.data.sources import DATASETS  # tfds loads here, not on import.
  config_lib.check(config.dataset in DATASETS,
                   f"dataset={config.dataset!r} is unknown; choose one of {sorted(DATASETS)}")


def checked_mesh(config: ml_collections.ConfigDict, devices=None):
  """The device mesh of `mesh_shape` over `devices` (default: all of this run's), after
  checking that they make it and that the batch sizes split over its data-parallel axes."""
  try:
    mesh = sharding.make_mesh(config.mesh_shape, devices)
  except ValueError as e:
    platform = devices[0].platform if devices else jax.default_backend()
    raise config_lib.ConfigError(f"{e} ({platform})") from None
  data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
  for field in ("batch_size", "eval_batch_size"):
    config_lib.check(config[field] % data_parallel == 0,
                     f"{field}={config[field]} does not split over the mesh's {data_parallel} "
                     "data-parallel devices (data x fsdp); use a multiple of it")
  micro = config.batch_size // config.grad_accum_steps
  config_lib.check(
      micro % data_parallel == 0,
      f"batch_size={config.batch_size} / grad_accum_steps={config.grad_accum_steps} = {micro} "
      f"rows a microbatch do not split over the mesh's {data_parallel} data-parallel devices")
  return mesh


def padded_vocab(size: int, multiple: int = 128) -> int:
  """Vocabulary rounded up so that it splits evenly over tensor-parallel devices."""
  return -(-size // multiple) * multiple


def attention_impl(requested: str, dtype: str, head_dim: int, platform: str | None = None) -> str:
  """`auto` picks cuDNN's fused attention where it applies (an NVIDIA GPU, bfloat16, head dim a
  multiple of 8 up to 128) and XLA's otherwise. `platform`: the one the program is compiled
  for ("gpu", "tpu", "cpu"); default: this process's backend."""
  if requested != "auto":
    return requested
  if platform is None:
    platform = jax.default_backend()
  cudnn_ok = (platform in ("gpu", "cuda") and dtype == "bfloat16"
              and head_dim % 8 == 0 and head_dim <= 128)
  return "cudnn" if cudnn_ok else "xla"


def model_config(config: ml_collections.ConfigDict, src_vocab: int, tgt_vocab: int,
                 platform: str | None = None) -> TransformerConfig:
  """The frozen model config; `platform` as in attention_impl."""
  fields = {f.name for f in dataclasses.fields(TransformerConfig)}
  kwargs = config.model.to_dict()
  unknown = sorted(set(kwargs) - fields)
  config_lib.check(not unknown, f"model.{unknown[0] if unknown else ''} is not a model field")
  kwargs["attention_impl"] = attention_impl(kwargs["attention_impl"], kwargs["dtype"],
                                            kwargs["d_model"] // kwargs["num_heads"], platform)
  return TransformerConfig(src_vocab_size=padded_vocab(src_vocab),
                           tgt_vocab_size=padded_vocab(tgt_vocab), **kwargs)


def data_config(config: ml_collections.ConfigDict):
  """The data path's fields as a frozen pipeline.DataConfig."""
  from transformer_jax.data.pipeline import DataConfig, resolve_workers
  fields = {f.name for f in dataclasses.fields(DataConfig)} - {"num_workers"}
  return DataConfig(num_workers=resolve_workers(config.num_workers),
                    **{k: config[k] for k in sorted(fields)})


def optimizer_config(config: ml_collections.ConfigDict):
  """The optimizer's fields as a frozen train_lib.OptimizerConfig."""
  from transformer_jax.train_lib import OptimizerConfig
  return OptimizerConfig(**{f.name: config[f.name] for f in dataclasses.fields(OptimizerConfig)})


def step_config(config: ml_collections.ConfigDict):
  """The train and eval steps' fields as a frozen train_lib.StepConfig."""
  from transformer_jax.train_lib import StepConfig
  return StepConfig(**{f.name: config[f.name] for f in dataclasses.fields(StepConfig)})
