"""The checks a run's config needs before anything is built that config.py cannot make without
importing a subsystem: the dataset against the registered builders, the device mesh against the
devices and the batch sizes."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_collections

from transformer_jax import config as config_lib, sharding
from transformer_jax.data.catalog import DATASETS
from transformer_jax.training import tasks


def validated(config: ml_collections.ConfigDict | config_lib.Config) -> config_lib.Config:
  """config.parse, and the dataset's name against the registered builders."""
  cfg = config_lib.parse(config)
  config_lib.check(cfg.data.dataset in DATASETS, f"data.dataset={cfg.data.dataset!r} is "
                   f"unknown; choose one of {sorted(DATASETS)}")
  corpus = tasks.of(cfg.model.family, cfg.data.dataset).corpus  # Raises for another family's.
  if corpus is tasks.LABELLED:  # A classifier: one text a row, one prediction a row.
    config_lib.check(not cfg.data.packing, "data.packing=True packs several texts a row; a "
                     "classifier reads one text a row: set data.packing=False")
    config_lib.check(cfg.step.loss_chunks == 1, f"step.loss_chunks={cfg.step.loss_chunks} "
                     "slices a vocabulary's logits; a classifier has none: set it to 1")
  else:
    config_lib.check(cfg.data.train_fraction == 1.0, f"data.train_fraction="
                     f"{cfg.data.train_fraction} picks labelled texts; data.dataset="
                     f"{cfg.data.dataset!r} holds {corpus.name}: leave it at 1.0")
  return cfg


def check_paths(cfg: config_lib.Config) -> None:
  """The paths a run reads: a data.data_dir given is a directory that holds files (tfds takes
  an empty one for none given and downloads instead: minutes of retries where the source is
  unreachable), a run.compiled_train_step given is a file. Only the trainer reads them: the
  commands that read a trained run never check a training-only path."""
  step_file = cfg.run.compiled_train_step
  config_lib.check(not step_file or Path(step_file).is_file(),
                   f"run.compiled_train_step={step_file!r} is not a file")
  data_dir = cfg.data.data_dir
  if not data_dir:
    return  # Downloaded from the dataset's source.
  if not Path(data_dir).is_dir():
    where = "" if Path(data_dir).is_absolute() else f" from {Path.cwd()}"
    raise config_lib.ConfigError(
        f"data.data_dir={data_dir!r} is not a directory{where}: pass the corpus's directory "
        "with --config.data.data_dir DIR (a run moved since it was trained keeps the path it "
        "was given then)")
  config_lib.check(any(p.is_file() for p in Path(data_dir).rglob("*")),
                   f"data.data_dir={data_dir!r} holds no file: put the corpus's raw files there "
                   "(python -m transformer_jax download --out DIR), or leave data_dir empty to "
                   "download them")


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
