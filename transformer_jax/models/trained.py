"""A trained run opened for use: its config, tokenizers and model, and a checkpoint's parameters
sharded over a mesh. What translate, generate, serve, average and init_from read of a workdir."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax import config as config_lib
from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.models import build
from transformer_jax.models.transformer import LanguageModel, Transformer
from transformer_jax.programs import ProgramStore
from transformer_jax.workdir import Workdir


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
                programs: ProgramStore = ProgramStore(None)) -> tuple[int, object]:
  """(step, parameters) of a checkpoint of `run`, sharded over `mesh` by their logical names:
  `step`'s, or the newest that reads back and verifies. `key`: "params" or "ema_params".
  `programs`: where the model's abstract parameters are kept for later commands (tracing its
  init takes about 0.5 s on a CPU)."""
  abstract = programs.value("abstract_params", repr((type(model).__name__, model.cfg)),
                            lambda: abstract_params(model))
  ckpt = run.checkpointer(read_only=True)
  try:
    if step is None:
      return ckpt.restore_params_latest(abstract, mesh, key)
    return step, ckpt.restore_params(step, abstract, mesh, key)
  finally:
    ckpt.close()


def abstract_params(model: Transformer | LanguageModel):
  """The model's parameters as shapes and dtypes, still boxed with their logical axis names
  (the checkpointer turns those into shardings); nothing runs."""
  dummy = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  inputs = (dummy, dummy) if model.cfg.family == "encoder_decoder" else (dummy,)
  # The key is made inside, so that nothing here runs (each op run eagerly is a program to
  # compile or load).
  return jax.eval_shape(lambda *x: model.init(jax.random.PRNGKey(0), *x), *inputs)["params"]


def layer_params(params, prefix: str, count: int) -> list[dict]:
  """Each layer's parameters, as unscanned models name them (encoder_0, ...), from either stack
  (a scanned one holds [layers, ...] arrays): what exports read layer by layer."""
  if f"{prefix}_stack" in params:
    stacked = params[f"{prefix}_stack"]["layers"]["block"]
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count)]
  return [params[f"{prefix}_{i}"] for i in range(count)]


def scanned_like(params: dict, template) -> dict:
  """`params` named as an unscanned model's (encoder_0, ...), in `template`'s layout: where it
  holds a scanned stack, the layers stacked into its [layers, ...] arrays (`layer_params`
  backwards)."""
  params = dict(params)
  for prefix in ("encoder", "decoder"):
    if f"{prefix}_stack" in template:
      count = sum(1 for name in params if name.startswith(f"{prefix}_") and name[-1].isdigit())
      layers = [params.pop(f"{prefix}_{i}") for i in range(count)]
      params[f"{prefix}_stack"] = {"layers": {"block": jax.tree.map(
          lambda *x: jnp.stack(x), *layers)}}
  return params
