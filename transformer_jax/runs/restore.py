"""A trained run opened for use, the one way every command opens one: its family checked, its
config, tokenizers and model, and a checkpoint's parameters (the moving average where the run
kept one) sharded over a mesh, with one log line. What translate, generate, fill, classify,
serve, export, average and init_from read of a workdir."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from absl import logging

from transformer_jax import config as config_lib, sharding
from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.models import build
from transformer_jax.models.transformer import LanguageModel, Transformer
from transformer_jax.programs import ProgramStore
from transformer_jax.runs.workdir import Workdir


class Opened(NamedTuple):
  """What decoding or averaging needs of a workdir, read and checked."""
  config: config_lib.Config
  tokenizers: Tokenizers
  model: Transformer | LanguageModel


def open_run(run: Workdir) -> Opened:
  """The run's config, tokenizers and model (no parameters: see `read_params`)."""
  config = run.load_config()
  tokenizers = run.tokenizers()
  model = build.build_model(build.model_config(
      config.model, tokenizers.src.vocab_size, tokenizers.tgt.vocab_size,
      max_len=config.data.max_len, num_labels=len(run.labels())))
  return Opened(config, tokenizers, model)


def read_params(run: Workdir, model: Transformer | LanguageModel, mesh, key: str = "params",
                step: int | None = None,
                programs: ProgramStore | None = None) -> tuple[int, object]:
  """(step, parameters) of a checkpoint of `run`, sharded over `mesh` by their logical names:
  `step`'s, or the newest that reads back and verifies. `key`: "params" or "ema_params".
  `programs`: where the model's abstract parameters are kept for later commands (tracing its
  init takes about 0.5 s on a CPU; None: not kept)."""
  programs = ProgramStore(None) if programs is None else programs
  abstract = programs.value("abstract_params", repr((type(model).__name__, model.cfg)),
                            lambda: build.abstract_params(model))
  ckpt = run.checkpointer(read_only=True)
  try:
    if step is None:
      return ckpt.restore_params_latest(abstract, mesh, key)
    return step, ckpt.restore_params(step, abstract, mesh, key)
  finally:
    ckpt.close()


@dataclasses.dataclass(frozen=True)
class Restored:
  """A trained run ready to use: `Opened`'s parts and one checkpoint's parameters."""
  run: Workdir
  config: config_lib.Config
  tokenizers: Tokenizers
  model: Transformer | LanguageModel
  step: int
  params: object
  uses_ema: bool  # Whether `params` are the parameters' moving average.


def restore(workdir: str | Path, kind: str | None = None, command: str = "",
            step: int | None = None, ema: bool = True,
            programs: ProgramStore | None = None, mesh=None) -> Restored:
  """`workdir` opened, its model checked to be of `kind` (a model.family or "classifier", which
  `command` needs; None: any), and the parameters of `step`'s checkpoint (default the newest
  that verifies) sharded over `mesh` (default: this machine's devices, replicated): their
  moving average where the run kept one and `ema`. `programs`: where the model's abstract
  parameters are kept for later commands."""
  run = Workdir(workdir)
  if kind is not None:
    run.check_family(kind, command)
  config, tokenizers, model = open_run(run)
  uses_ema = ema and config.eval_params_kept
  mesh = sharding.make_mesh((-1, 1, 1)) if mesh is None else mesh
  step, params = read_params(run, model, mesh,
                             "ema_params" if uses_ema else "params", step, programs)
  logging.info("Restored step %d from %s (%s)", step, run.checkpoints,
               "the parameters' moving average" if uses_ema else "the parameters")
  return Restored(run, config, tokenizers, model, step, params, uses_ema)
