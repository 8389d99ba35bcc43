"""From a checked config to what the subsystems run with: the dataset's name, the device mesh,
the model's frozen config with its vocabularies.

config.py knows the sections and checks their fields without importing a subsystem; the checks
here need one (the registered datasets, the devices, the tokenizers' sizes).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from transformer_jax import config as config_lib, embedding, sharding
from transformer_jax.data.catalog import DATASETS
from transformer_jax.model import LanguageModel, Transformer, TransformerConfig, attention_impl


def validated(config: ml_collections.ConfigDict | config_lib.Config) -> config_lib.Config:
  """config.parse, and the dataset's name against the registered builders."""
  cfg = config_lib.parse(config)
  config_lib.check(cfg.data.dataset in DATASETS, f"data.dataset={cfg.data.dataset!r} is "
                   f"unknown; choose one of {sorted(DATASETS)}")
  documents = DATASETS[cfg.data.dataset].documents
  config_lib.check(documents == (cfg.model.family == "decoder_only"),
                   f"data.dataset={cfg.data.dataset!r} holds "
                   f"{'documents, for' if documents else 'sentence pairs, for'} "
                   f"{'decoder_only' if documents else 'encoder_decoder'} models; "
                   f"model.family={cfg.model.family!r}")
  return cfg


def checked_mesh(cfg: config_lib.Config, devices=None):
  """The device mesh of `run.mesh_shape` over `devices` (default: all of this run's), after
  checking that they make it and that the batch sizes split over its data-parallel axes."""
  try:
    mesh = sharding.make_mesh(cfg.run.mesh_shape, devices)
  except ValueError as e:
    platform = devices[0].platform if devices else jax.default_backend()
    raise config_lib.ConfigError(f"run.{e} ({platform})") from None
  data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
  for field, size in (("data.batch_size", cfg.data.batch_size),
                      ("eval.batch_size", cfg.eval.batch_size)):
    config_lib.check(size % data_parallel == 0,
                     f"{field}={size} does not split over the mesh's {data_parallel} "
                     "data-parallel devices (data x fsdp); use a multiple of it")
  accum = cfg.step.grad_accum_steps
  micro = cfg.data.batch_size // accum
  config_lib.check(
      micro % data_parallel == 0,
      f"data.batch_size={cfg.data.batch_size} / step.grad_accum_steps={accum} = {micro} "
      f"rows a microbatch do not split over the mesh's {data_parallel} data-parallel devices")
  return mesh


def padded_vocab(size: int, multiple: int = 128) -> int:
  """Vocabulary rounded up so that it splits evenly over tensor-parallel devices."""
  return -(-size // multiple) * multiple


def model_config(model: config_lib.ModelConfig, src_vocab: int, tgt_vocab: int,
                 platform: str | None = None, max_len: int = 0) -> TransformerConfig:
  """The frozen model config of the model section and the tokenizers' vocabularies (padded);
  `platform`: the one the program is compiled for (picks `auto`'s attention_impl and
  embed_grad); `max_len`: data.max_len (the rows of learned positions)."""
  fields = dataclasses.asdict(model)
  fields["embed_grad"] = embedding.grad_impl(model.embed_grad, platform)
  # Pallas kernels run natively on TPUs only.
  fields["interpret_kernels"] = (platform or jax.default_backend()) != "tpu"
  fields["attention_impl"] = attention_impl(model.attention_impl, model.dtype,
                                            model.d_model // model.num_heads, platform)
  return TransformerConfig(src_vocab_size=padded_vocab(src_vocab),
                           tgt_vocab_size=padded_vocab(tgt_vocab), max_len=max_len, **fields)


def build_model(cfg: TransformerConfig) -> Transformer | LanguageModel:
  """The module of the config's family."""
  return LanguageModel(cfg) if cfg.family == "decoder_only" else Transformer(cfg)
