"""Fine-tuning: a new run that starts from another run's parameters (`run.init_from`).

The new run begins at step 0 with a fresh optimizer state and its own schedule, on its own data,
with the other run's tokenizer (the vocabulary the parameters were trained with). The other run
must hold the same model: every field that shapes the parameters, and the same tokenizer kind
and vocabulary size (and max_len, with learned positions). A classifier may start from a masked
language model of the same shape: it takes the encoder, and its head starts afresh. The
parameters taken are the ones the other run decodes with: its moving average where it kept one.
Once the new run has a checkpoint of its own, it resumes from that, and `init_from` is not read
again.

`init_from` may also name a local Hugging Face checkpoint of GPT-2 or BERT (interop/huggingface.py):
the run then takes that checkpoint's tokenizer (data.tokenizer='huggingface') and must hold its
model (the fields `Checkpoint.model_fields` names; data.max_len at most its positions).
"""

from __future__ import annotations

import dataclasses

import jax
from absl import logging

from transformer_jax import config as config_lib
from transformer_jax.errors import UserError
from transformer_jax.runs import restore
from transformer_jax.interop import huggingface
from transformer_jax.models import build
from transformer_jax.runs.workdir import Workdir

# Model fields that change what is computed but not the parameters' names or shapes.
FREE_MODEL_FIELDS = ("dropout_rate", "dtype", "attention_impl", "remat")


class InitFromError(UserError, ValueError):
  """run.init_from names a run this one cannot start from."""


def check_source(cfg: config_lib.Config, init_from: str) -> Workdir | huggingface.Checkpoint:
  """The workdir or Hugging Face checkpoint to start from, checked before anything is written:
  a trained run (config, tokenizer, checkpoints) or a checkpoint of the same model. Raises
  InitFromError (or huggingface.CheckpointError) naming the first problem."""
  source = Workdir(init_from)
  where = f"run.init_from={init_from!r}"
  if not source.path.is_dir():
    raise InitFromError(f"{where} is not a directory")
  if huggingface.is_checkpoint(source.path):
    return _check_checkpoint(cfg, huggingface.Checkpoint.open(source.path), where)
  if cfg.data.tokenizer == "huggingface":
    raise InitFromError(f"{where} is not a Hugging Face checkpoint (a config.json naming its "
                        "model_type), whose tokenizer data.tokenizer='huggingface' takes")
  if not source.config_file.is_file():
    raise InitFromError(f"{where} holds no config.json: not a training workdir or a Hugging "
                        "Face checkpoint")
  saved = source.load_config()
  if not source.checkpoint_steps():
    raise InitFromError(f"{where} holds no checkpoint to start from")
  source.tokenizers()  # Raises where there is none.
  # The tokenizer's ids, and the rows of learned positions.
  shaping = ("tokenizer", "vocab_size") + (("max_len",) if cfg.model.positions == "learned"
                                           else ())
  differences = [(f"data.{k}", getattr(cfg.data, k), getattr(saved.data, k)) for k in shaping]
  differences += [(f"model.{k}", v, getattr(saved.model, k))
                  for k, v in dataclasses.asdict(cfg.model).items()
                  if k not in FREE_MODEL_FIELDS]
  differences = [(name, ours, theirs) for name, ours, theirs in differences if ours != theirs]
  if differences:
    raise InitFromError(f"{where} is another model: " + "; ".join(
        f"{name} is {ours!r} here and {theirs!r} there" for name, ours, theirs in differences))
  return source


def _check_checkpoint(cfg: config_lib.Config, checkpoint: huggingface.Checkpoint,
                      where: str) -> huggingface.Checkpoint:
  """`checkpoint` if this run can start from it: its tokenizer, its model, its positions."""
  if cfg.data.tokenizer != "huggingface":
    raise InitFromError(f"{where} is a Hugging Face checkpoint: the run reads its tokenizer "
                        f"(set data.tokenizer='huggingface', not {cfg.data.tokenizer!r})")
  differences = [(f"model.{k}", getattr(cfg.model, k), theirs)
                 for k, theirs in checkpoint.model_fields().items()
                 if getattr(cfg.model, k) != theirs]
  if differences:
    raise InitFromError(f"{where} is another model ({checkpoint.architecture}): " + "; ".join(
        f"{name} is {ours!r} here and {theirs!r} there" for name, ours, theirs in differences))
  if cfg.data.max_len > checkpoint.max_len:
    raise InitFromError(f"{where} holds {checkpoint.max_len} positions; data.max_len="
                        f"{cfg.data.max_len} needs as many")
  # Its tokenizer and every weight read and mapped once here (each raising where it cannot be),
  # so that a tensor of another shape than its config.json says stops the run before it writes.
  tokenizer = checkpoint.tokenizers().tgt
  checkpoint.params(build.model_config(cfg.model, tokenizer.vocab_size, tokenizer.vocab_size,
                                       max_len=cfg.data.max_len), tokenizer)
  return checkpoint


def start_from(state, source: Workdir | huggingface.Checkpoint, model, mesh, shardings):
  """`state` (a fresh one, step 0) with the parameters of `source`'s newest checkpoint that
  verifies (its moving average where it kept one); its moving average, where this run keeps
  one, starts from them too. The model's parts that `source` lacks (a classifier's head, when
  it is a masked language model) keep their fresh initialization, and the parts of `source`
  this model lacks (the masked-LM head) are left out, both logged."""
  if isinstance(source, huggingface.Checkpoint):
    taken = source.params(model.cfg, source.tokenizers().tgt)
    taken = build.scanned_like(taken, state.params)
    origin = f"the weights of {source.path} ({source.architecture})"
  else:
    restored = restore.restore(source.path, mesh=mesh)
    taken = restored.params
    origin = (f"the {'moving average of the ' if restored.uses_ema else ''}parameters of "
              f"step {restored.step} of {source.path}")
  params = dict(state.params)
  for name in params.keys() & taken.keys():
    ours, theirs = (jax.tree.map(lambda x: (x.shape, x.dtype), t)
                    for t in (params[name], taken[name]))
    if ours != theirs:  # check_source compares the fields that shape them: a bug if reached.
      raise InitFromError(f"run.init_from={str(source.path)!r}: its parameters {name!r} have "
                          "other shapes than this model's")
    params[name] = taken[name]
  fresh, left = sorted(params.keys() - taken.keys()), sorted(taken.keys() - params.keys())
  if fresh or left:
    logging.info("From %s: kept %s; initialized afresh: %s; left out: %s", source.path,
                 ", ".join(sorted(params.keys() & taken.keys())), ", ".join(fresh) or "none",
                 ", ".join(left) or "none")
  params = jax.device_put(params, shardings.params)
  ema = None if state.ema_params is None else jax.device_put(params, shardings.ema_params)
  logging.info("Starting from %s, with a fresh optimizer state", origin)
  return state.replace(params=params, ema_params=ema)
