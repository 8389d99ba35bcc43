"""A run's directory: the one place its layout is spelled, and how a command opens one.

  WORKDIR/
    config.json          the config the run trains with (written by train.py)
    tokenizer.model      the SentencePiece model (or vocab.json: d2l's word vocabularies)
    checkpoints/STEP/    orbax checkpoints: train state, data position, fingerprints
    metrics.jsonl        training and evaluation scalars; TensorBoard events beside it
    jax_cache/           JAX's compilation cache (unless compilation_cache_dir says otherwise)

train.py resumes from one; translate, average, visualize and the AOT tools open one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import ml_collections
import numpy as np
from absl import logging

from transformer_jax import checkpoint, config as config_lib, sections
from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.errors import UserError
from transformer_jax.model import Transformer

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
JAX_CACHE = "jax_cache"


class WorkdirError(UserError, ValueError):
  """A directory that is not a (usable) training workdir."""


class Opened(NamedTuple):
  """What decoding or averaging needs of a workdir, read and checked."""
  config: ml_collections.ConfigDict
  tokenizers: Tokenizers
  model: Transformer


class Workdir:
  """A training run's directory (it need not exist yet)."""

  def __init__(self, path: str | Path):
    if not str(path).strip():
      raise WorkdirError("--workdir is empty; name a directory for the run")
    self.path = Path(path)

  def __str__(self) -> str:
    return str(self.path)

  @property
  def config_file(self) -> Path:
    return self.path / CONFIG

  @property
  def checkpoints(self) -> Path:
    return self.path / CHECKPOINTS

  @property
  def jax_cache(self) -> Path:
    return self.path / JAX_CACHE

  def checkpoint_steps(self) -> list[int]:
    """Steps of the checkpoint directories present (verified or not), ascending."""
    return sorted(int(p.name) for p in self.checkpoints.glob("[0-9]*") if p.name.isdigit())

  # The config.

  def load_config(self) -> ml_collections.ConfigDict:
    """The config the run was trained with.

    Raises:
      WorkdirError: the workdir holds no config.json, or a damaged one.
    """
    if not self.config_file.is_file():
      raise WorkdirError(f"{self.path} holds no {CONFIG}: not a training workdir")
    try:
      saved = json.loads(self.config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise WorkdirError(f"{self.config_file} is damaged ({e}); restore it from a copy") from None
    if not isinstance(saved, dict):
      raise WorkdirError(f"{self.config_file} is damaged (not a JSON object); restore it from a "
                         "copy")
    return ml_collections.ConfigDict(saved)

  def write_config(self, config: ml_collections.ConfigDict) -> None:
    """Replaces config.json whole: another host may be reading the previous one."""
    self.path.mkdir(parents=True, exist_ok=True)
    partial = self.path / (CONFIG + ".tmp")
    partial.write_text(config.to_json_best_effort(indent=2))
    partial.replace(self.config_file)

  def check_resumable(self, config: ml_collections.ConfigDict) -> None:
    """The checks a run of `config` in this workdir needs before anything is created: the
    checkpoints are of the same model, and num_steps is not below the latest one's step."""
    if self.path.exists() and not self.path.is_dir():
      raise WorkdirError(f"--workdir {self.path} is a file, not a directory")
    steps = self.checkpoint_steps()
    if steps and self.config_file.exists():
      saved_json = self.config_file.read_text()
      try:
        json.loads(saved_json)
      except json.JSONDecodeError as e:
        raise WorkdirError(f"{self.config_file} is damaged ({e}); restore it from a copy or "
                           "start a new workdir") from None
      check_same_model(saved_json, config)
      _warn_if_the_learning_rates_move(saved_json, config, steps[-1])
    if steps and steps[-1] > config.num_steps:
      raise WorkdirError(
          f"num_steps={config.num_steps} is below the latest checkpoint's step ({steps[-1]}) "
          f"in {self.checkpoints}; raise num_steps to train on, or use a new workdir")

  # Opening a trained run.

  def tokenizers(self) -> Tokenizers:
    tokenizers = Tokenizers.load(self.path)
    if tokenizers is None:
      raise WorkdirError(f"{self.path} holds no tokenizer (tokenizer.model or vocab.json)")
    return tokenizers

  def open(self) -> Opened:
    """The run's config, tokenizers and model (no parameters: see `checkpointer`)."""
    config = self.load_config()
    tokenizers = self.tokenizers()
    model = Transformer(sections.model_config(config, tokenizers.src.vocab_size,
                                              tokenizers.tgt.vocab_size))
    return Opened(config, tokenizers, model)

  def checkpointer(self, save_every: int = 1, keep: int = 1,
                   read_only: bool = False) -> checkpoint.Checkpointer:
    if read_only and not self.checkpoints.is_dir():
      raise WorkdirError(f"{self.path} holds no {CHECKPOINTS}/ directory")
    return checkpoint.Checkpointer(self.checkpoints, save_every, keep, read_only=read_only)

  def copy_run_files(self, to: Path, tokenizers: Tokenizers) -> None:
    """config.json and the tokenizer into the directory `to` (a derived workdir)."""
    to.mkdir(parents=True, exist_ok=True)
    (to / CONFIG).write_bytes(self.config_file.read_bytes())
    tokenizers.save(to)


def check_same_model(saved_json: str, config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError if a workdir's saved config describes another model (a resumed run
  must not restore, say, unscanned parameters into a scanned model)."""
  saved_config = json.loads(saved_json)
  saved, current = saved_config.get("model", {}), config.model.to_dict()
  changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
  fields = ("dataset", "tokenizer", "vocab_size")
  changed += [k for k in fields if saved_config.get(k) != config[k]]
  if bool(saved_config.get("ema_decay", 0)) != bool(config.ema_decay):
    changed.append("ema_decay")  # The checkpoints hold a moving average or do not.
  fields += ("ema_decay",)
  config_lib.check(not changed, "the workdir's checkpoints are of another model: "
                   + ", ".join(f"{'' if k in fields else 'model.'}{k}" for k in changed)
                   + f" differ from its {CONFIG}")


def _warn_if_the_learning_rates_move(saved_json: str, config: ml_collections.ConfigDict,
                                     from_step: int) -> None:
  """Logs a warning when the run resumed from `from_step` would follow other learning rates
  than the one in the workdir's config.json (say, a cosine schedule, which spans num_steps,
  with another num_steps): allowed, as extending a run is, but not silently."""
  from transformer_jax.train_lib import OptimizerConfig, learning_rate_schedule
  saved = json.loads(saved_json)
  names = [f.name for f in dataclasses.fields(OptimizerConfig)]
  before = sections.optimizer_config(ml_collections.ConfigDict(
      {k: saved.get(k, config[k]) for k in names}))  # A field the run predates: as now.
  after = sections.optimizer_config(config)
  steps = np.arange(from_step, min(before.num_steps, after.num_steps) + 1)
  if np.array_equal(learning_rate_schedule(before)(steps), learning_rate_schedule(after)(steps)):
    return
  changed = ", ".join(f"{k}={getattr(after, k)!r} (the run's: {getattr(before, k)!r})"
                      for k in names if getattr(before, k) != getattr(after, k))
  logging.warning("%s: the learning rates from the checkpoint of step %d on are not the ones "
                  "the run was following", changed, from_step)
