"""The checks a run makes of its workdir before it creates anything: that the workdir is a run's,
that its checkpoints are of the same model, that run.num_steps reaches past them; and a warning
where the resumed run would follow other learning rates."""

from __future__ import annotations

import dataclasses

import numpy as np
from absl import logging

from transformer_jax import config as config_lib
from transformer_jax.training.steps import learning_rate_schedule
from transformer_jax.runs.workdir import CONFIG, Workdir, WorkdirError


def check_resumable(run: Workdir, cfg: config_lib.Config) -> None:
  """The checks a run of the checked config `cfg` in `run` needs before anything is created:
  the checkpoints are of the same model, and run.num_steps is not below the latest one's step."""
  if run.path.exists() and not run.path.is_dir():
    raise WorkdirError(f"--workdir {run.path} is a file, not a directory")
  run.check_is_a_run()
  steps = run.checkpoint_steps()
  if steps and run.config_file.exists():
    saved = run.load_config()
    check_same_model(saved, cfg)
    _warn_if_the_learning_rates_move(saved, cfg, steps[-1])
  if steps and steps[-1] > cfg.run.num_steps:
    raise WorkdirError(
        f"run.num_steps={cfg.run.num_steps} is below the latest checkpoint's step "
        f"({steps[-1]}) in {run.checkpoints}; raise it to train on, or use a new workdir")


def check_same_model(saved: config_lib.Config, cfg: config_lib.Config) -> None:
  """Raises ConfigError if a workdir's saved config describes another model (a resumed run
  must not restore, say, unscanned parameters into a scanned model)."""
  before, after = dataclasses.asdict(saved.model), dataclasses.asdict(cfg.model)
  # How the embedding gradient, the attention and rematerialization are computed, and the
  # dropout rate, change no parameter: a run may resume with others.
  free = ("embed_grad", "remat", "attention_impl", "dropout_rate")
  changed = [(f"model.{k}", after[k], before[k]) for k in after
             if before[k] != after[k] and k not in free]
  shaping = ("dataset", "tokenizer", "vocab_size")
  if cfg.model.positions == "learned":  # A row of parameters for each position.
    shaping += ("max_len",)
  changed += [(f"data.{k}", getattr(cfg.data, k), getattr(saved.data, k)) for k in shaping
              if getattr(saved.data, k) != getattr(cfg.data, k)]
  if bool(saved.step.ema_decay) != bool(cfg.step.ema_decay):
    # The checkpoints hold a moving average or do not.
    changed.append(("step.ema_decay", cfg.step.ema_decay, saved.step.ema_decay))
  if saved.optimizer.name != cfg.optimizer.name:  # Their states are of another optimizer's.
    changed.append(("optimizer.name", cfg.optimizer.name, saved.optimizer.name))
  config_lib.check(not changed, "the workdir's checkpoints are of another model: " + ", ".join(
      f"{name}={now!r} (its {CONFIG}: {was!r})" for name, now, was in changed))


def _warn_if_the_learning_rates_move(saved: config_lib.Config, cfg: config_lib.Config,
                                     from_step: int) -> None:
  """Logs a warning when the run resumed from `from_step` would follow other learning rates
  than the one in the workdir's config.json (say, a cosine schedule, which spans num_steps,
  with another num_steps): allowed, as extending a run is, but not silently."""
  before = (saved.optimizer, saved.run.num_steps)
  after = (cfg.optimizer, cfg.run.num_steps)
  steps = np.arange(from_step, min(before[1], after[1]) + 1)
  if np.array_equal(learning_rate_schedule(*before)(steps), learning_rate_schedule(*after)(steps)):
    return
  changed = [f"optimizer.{k}={v!r} (the run's: {getattr(saved.optimizer, k)!r})"
             for k, v in dataclasses.asdict(cfg.optimizer).items()
             if getattr(saved.optimizer, k) != v]
  if before[1] != after[1]:
    changed.insert(0, f"run.num_steps={after[1]} (the run's: {before[1]})")
  logging.warning("%s: the learning rates from the checkpoint of step %d on are not the ones "
                  "the run was following", ", ".join(changed), from_step)
