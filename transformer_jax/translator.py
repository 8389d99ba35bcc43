"""A trained model restored from a workdir (config, tokenizer, the newest checkpoint that
verifies), with a jitted generate function.

Only the parameters are read from the checkpoint (not the optimizer state), onto whatever
devices this machine has.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax import checkpoint, config as config_lib, sharding
from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.generation import (DecodeOptions, InferenceError, encode_sources, generate,
                                        strip)
from transformer_jax.model import Transformer


class Translator:
  """Restores a workdir's model and tokenizer and translates batches of sentences."""

  def __init__(self, workdir: str | Path, step: int | None = None, ema: bool = True):
    """`ema`: decode with the parameters' moving average where the run kept one (ema_decay >
    0), else with the parameters themselves."""
    workdir = Path(workdir)
    try:
      self.config = config_lib.load_saved(workdir)
    except config_lib.ConfigError as e:
      raise InferenceError(str(e)) from None
    tokenizers = Tokenizers.load(workdir)
    if tokenizers is None:
      raise InferenceError(f"{workdir} holds no tokenizer (tokenizer.model or vocab.json)")
    self.tokenizers = tokenizers
    self.model_config = config_lib.model_config(
        self.config, tokenizers.src.vocab_size, tokenizers.tgt.vocab_size)
    self.model = Transformer(self.model_config)
    ckpt_dir = workdir / "checkpoints"
    if not ckpt_dir.is_dir():
      raise InferenceError(f"{workdir} holds no checkpoints/ directory")
    ckpt = checkpoint.Checkpointer(ckpt_dir, save_every=1, keep=1, read_only=True)
    mesh = sharding.make_mesh((-1, 1, 1))
    self.uses_ema = ema and self.config.get("ema_decay", 0) > 0
    key = "ema_params" if self.uses_ema else "params"
    try:
      if step is None:  # The newest that reads back and verifies.
        self.step, self.params = ckpt.restore_params_latest(self._abstract_params(), mesh, key)
      else:
        self.step = step
        self.params = ckpt.restore_params(step, self._abstract_params(), mesh, key)
    except (checkpoint.CheckpointDamagedError, checkpoint.CheckpointNotFoundError,
            checkpoint.CheckpointMismatchError) as e:
      raise InferenceError(str(e)) from None
    finally:
      ckpt.close()
    self.max_src_len = int(self.config.max_len)
    self.max_output_len = 4 * self.max_src_len  # Longer outputs than this are refused.
    logging.info("Restored step %d from %s (%s)", self.step, ckpt_dir,
                 "the parameters' moving average" if self.uses_ema else "the parameters")

  @property
  def src_lang(self) -> str:
    """The source language's code (e.g. "en"), from the dataset the model was trained on."""
    from transformer_jax.data.sources import DATASETS  # tfds: imported only when asked.
    return DATASETS[self.config.dataset].src_lang

  def _abstract_params(self):
    dummy = jnp.ones((1, 2), jnp.int32)
    boxed = jax.eval_shape(self.model.init, jax.random.PRNGKey(0), dummy, dummy)["params"]
    return boxed  # Still boxed: the checkpointer turns the names into shardings.

  @functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
  def generate_ids(self, params, src, max_len, beam_size, alpha):
    """src [B, S] -> best output tokens [B, max_len]; compiled once per shape and options."""
    return generate(self.model, params, src, max_len, beam_size, alpha)

  def translate(self, sentences: list[str], options: DecodeOptions = DecodeOptions(),
                numbers: list[int] | None = None) -> list[str]:
    """`numbers`: the sentences' line numbers, for warnings (default: 1, 2, ...)."""
    src = encode_sources(self.tokenizers.src, sentences, self.max_src_len, numbers=numbers)
    max_len = options.max_len or src.shape[1] + options.max_len_margin
    tokens = np.asarray(self.generate_ids(self.params, src, max_len, options.beam_size,
                                       options.alpha))
    return [self.tokenizers.tgt.decode(strip(row)) for row in tokens]
