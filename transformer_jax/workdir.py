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

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import checkpoint, config as config_lib, errors, sections
from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.errors import UserError
from transformer_jax.model import LanguageModel, Transformer
from transformer_jax.programs import ProgramStore

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
JAX_CACHE = "jax_cache"
# What a run may have written before its config.json (besides TensorBoard's event files).
_WRITTEN_BEFORE_CONFIG = {CHECKPOINTS, JAX_CACHE, "tokenizer.model", "vocab.json",
                          "metrics.jsonl"}


class WorkdirError(UserError, ValueError):
  """A directory that is not a (usable) training workdir."""


class Opened(NamedTuple):
  """What decoding or averaging needs of a workdir, read and checked."""
  config: config_lib.Config
  tokenizers: Tokenizers
  model: Transformer | LanguageModel


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

  def load_config(self) -> config_lib.Config:
    """The config the run was trained with: its sections, each field this version added since
    taken from the defaults (a config.json from before sections is read too).

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
    if not config_lib.names_this_projects_fields(saved):
      raise WorkdirError(f"{self.config_file} is not a training run's config (it names none of "
                         f"the config's sections or fields): {self.path} is not a training "
                         "workdir")
    try:
      return config_lib.parse(saved, saved=True)
    except (config_lib.ConfigError, TypeError) as e:
      raise WorkdirError(f"{self.config_file} is damaged ({errors.first_line(e)}); restore it "
                         "from a copy") from None

  def write_config(self, cfg: config_lib.Config) -> None:
    """Replaces config.json whole: another host may be reading the previous one."""
    self.path.mkdir(parents=True, exist_ok=True)
    partial = self.path / (CONFIG + ".tmp")
    partial.write_text(json.dumps(cfg.to_dict(), indent=2))
    partial.replace(self.config_file)

  def check_resumable(self, cfg: config_lib.Config | ml_collections.ConfigDict) -> None:
    """The checks a run of `cfg` in this workdir needs before anything is created: the
    checkpoints are of the same model, and run.num_steps is not below the latest one's step."""
    cfg = config_lib.parse(cfg)
    if self.path.exists() and not self.path.is_dir():
      raise WorkdirError(f"--workdir {self.path} is a file, not a directory")
    self.check_is_a_run()
    steps = self.checkpoint_steps()
    if steps and self.config_file.exists():
      saved = self.load_config()
      check_same_model(saved, cfg)
      _warn_if_the_learning_rates_move(saved, cfg, steps[-1])
    if steps and steps[-1] > cfg.run.num_steps:
      raise WorkdirError(
          f"run.num_steps={cfg.run.num_steps} is below the latest checkpoint's step "
          f"({steps[-1]}) in {self.checkpoints}; raise it to train on, or use a new workdir")

  def check_is_a_run(self) -> None:
    """Raises WorkdirError unless the directory is missing, empty, or a run's: train.py writes
    into nothing else. A run's holds this project's config.json or, where it stopped before
    writing one, only what a run writes first (and hidden files)."""
    if not self.path.is_dir() or not any(self.path.iterdir()):
      return
    if self.config_file.exists():
      self.load_config()  # Raises where it is another program's config.json, or damaged.
      return
    foreign = sorted(p.name for p in self.path.iterdir()  # Hidden files (.DS_Store) aside.
                     if p.name not in _WRITTEN_BEFORE_CONFIG
                     and not p.name.startswith(("events.out.tfevents.", ".")))
    if foreign:
      shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
      raise WorkdirError(f"--workdir {self.path} is not a training workdir (it holds {shown} "
                         f"and no {CONFIG}): name a new or empty directory, or a run's")

  # Opening a trained run.

  def tokenizers(self) -> Tokenizers:
    tokenizers = Tokenizers.load(self.path)
    if tokenizers is None:
      raise WorkdirError(f"{self.path} holds no tokenizer (tokenizer.model or vocab.json)")
    return tokenizers

  def check_family(self, family: str, command: str) -> None:
    """A one-line WorkdirError where the run's model is not of `family` (`command` needs it)."""
    saved = self.load_config().model.family
    if saved != family:
      kind = {"encoder_decoder": "translation model", "decoder_only": "language model"}
      use = "generate" if saved == "decoder_only" else "translate"
      raise WorkdirError(f"{self.path} holds a {kind[saved]} (model.family={saved!r}): "
                         f"`{command}` needs a {kind[family]}; use `{use}`")

  def open(self) -> Opened:
    """The run's config, tokenizers and model (no parameters: see `checkpointer`)."""
    config = self.load_config()
    tokenizers = self.tokenizers()
    model = sections.build_model(sections.model_config(
        config.model, tokenizers.src.vocab_size, tokenizers.tgt.vocab_size,
        max_len=config.data.max_len))
    return Opened(config, tokenizers, model)

  def checkpointer(self, save_every: int = 1, keep: int = 1,
                   read_only: bool = False) -> checkpoint.Checkpointer:
    if read_only and not self.checkpoints.is_dir():
      raise WorkdirError(f"{self.path} holds no {CHECKPOINTS}/ directory")
    tokenizers = Tokenizers.load(self.path)
    return checkpoint.Checkpointer(self.checkpoints, save_every, keep, read_only=read_only,
                                   tokenizer_digest=tokenizers and tokenizers.digest())

  def read_params(self, model: Transformer | LanguageModel, mesh, key: str = "params",
                  step: int | None = None,
                  programs: ProgramStore = ProgramStore(None)) -> tuple[int, object]:
    """(step, parameters) of a checkpoint, sharded over `mesh` by their logical names: `step`'s,
    or the newest that reads back and verifies. `key`: "params" or "ema_params". `programs`:
    where the model's abstract parameters are kept for later commands (tracing its init takes
    about 0.5 s on a CPU)."""
    abstract = programs.value("abstract_params", repr((type(model).__name__, model.cfg)),
                              lambda: abstract_params(model))
    ckpt = self.checkpointer(read_only=True)
    try:
      if step is None:
        return ckpt.restore_params_latest(abstract, mesh, key)
      return step, ckpt.restore_params(step, abstract, mesh, key)
    finally:
      ckpt.close()

  def copy_run_files(self, to: Path, tokenizers: Tokenizers) -> None:
    """config.json and the tokenizer into the directory `to` (a derived workdir)."""
    to.mkdir(parents=True, exist_ok=True)
    (to / CONFIG).write_bytes(self.config_file.read_bytes())
    tokenizers.save(to)


def abstract_params(model: Transformer | LanguageModel):
  """The model's parameters as shapes and dtypes, still boxed with their logical axis names
  (the checkpointer turns those into shardings); nothing runs."""
  dummy = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  inputs = (dummy,) if model.cfg.family == "decoder_only" else (dummy, dummy)
  # The key is made inside, so that nothing here runs (each op run eagerly is a program to
  # compile or load).
  return jax.eval_shape(lambda *x: model.init(jax.random.PRNGKey(0), *x), *inputs)["params"]


def check_same_model(saved: config_lib.Config, cfg: config_lib.Config) -> None:
  """Raises ConfigError if a workdir's saved config describes another model (a resumed run
  must not restore, say, unscanned parameters into a scanned model)."""
  saved, cfg = config_lib.parse(saved), config_lib.parse(cfg)
  before, after = dataclasses.asdict(saved.model), dataclasses.asdict(cfg.model)
  # How the embedding gradient is formed changes no parameter: a run may resume with another.
  changed = [f"model.{k}" for k in after if before[k] != after[k] and k != "embed_grad"]
  shaping = ("dataset", "tokenizer", "vocab_size")
  if cfg.model.positions == "learned":  # A row of parameters for each position.
    shaping += ("max_len",)
  changed += [f"data.{k}" for k in shaping if getattr(saved.data, k) != getattr(cfg.data, k)]
  if bool(saved.step.ema_decay) != bool(cfg.step.ema_decay):
    changed.append("step.ema_decay")  # The checkpoints hold a moving average or do not.
  config_lib.check(not changed, "the workdir's checkpoints are of another model: "
                   + ", ".join(changed) + f" differ from its {CONFIG}")


def _warn_if_the_learning_rates_move(saved: config_lib.Config, cfg: config_lib.Config,
                                     from_step: int) -> None:
  """Logs a warning when the run resumed from `from_step` would follow other learning rates
  than the one in the workdir's config.json (say, a cosine schedule, which spans num_steps,
  with another num_steps): allowed, as extending a run is, but not silently."""
  from transformer_jax.train_lib import learning_rate_schedule
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
