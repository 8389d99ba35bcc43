"""A trained model restored from a workdir, with jitted encode + decode functions.

Only the parameters are read from the checkpoint (not the optimizer state), onto whatever
devices this machine has.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from absl import logging

from transformer_jax import checkpoint, config as config_lib, decode, sharding
from transformer_jax.data.tokenizer import EOS, Tokenizers
from transformer_jax.metrics import corpus_bleu
from transformer_jax.model import Transformer, TransformerConfig


class InferenceError(ValueError):
  """The workdir, checkpoint or input cannot be used."""


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  beam_size: int = 1  # 1: greedy (or sampling, with a sampler).
  alpha: float = 0.6  # GNMT length penalty, beam search only.
  max_len_margin: int = 10  # Decode up to source length + margin tokens ...
  max_len: int = 0  # ... or exactly this many, when positive.


def encode_and_cache(model: Transformer, params, src, max_len: int):
  """src [B, S] -> decoding cache (encoder run once, cross-attention keys/values computed)."""
  segments = (src != 0).astype(jnp.int32)
  memory = model.apply({"params": params}, src, segments, method=Transformer.encode)
  return model.apply({"params": params}, memory, segments, max_len, method=Transformer.init_cache)


def tokens_to_logits_fn(model: Transformer, params):
  return lambda tokens, cache: model.apply({"params": params}, tokens, cache,
                                           method=Transformer.decode_step)


def generate(model: Transformer, params, src, max_len: int, beam_size: int = 1,
             alpha: float = 0.6, sampler=decode.Greedy(), rng=None):
  """src [B, S] -> tokens [B, max_len] (best beam), jit-able with static max_len/beam_size."""
  cache = encode_and_cache(model, params, src, max_len)
  step = tokens_to_logits_fn(model, params)
  if beam_size > 1:
    tokens, _ = decode.beam_search(step, cache, src.shape[0], max_len, beam_size, alpha)
    return tokens[:, 0]
  return decode.sample(step, cache, src.shape[0], max_len, sampler, rng)


def encode_sources(tokenizer, sentences: list[str], max_src_len: int,
                   width: int | None = None) -> np.ndarray:
  """Source token ids with <eos>, [B, width]; width defaults to the longest row rounded up to 8
  (few distinct shapes, few compilations). Overlong sentences are truncated with a warning;
  an empty one is an error."""
  ids = []
  for i, row in enumerate(tokenizer.encode(sentences)):
    if not sentences[i].strip() or not row:
      raise InferenceError(f"sentence {i + 1} is empty")
    row = list(row) + [EOS]
    if len(row) > max_src_len:
      logging.warning("sentence %d has %d tokens; truncated to the model's %d", i + 1, len(row),
                      max_src_len)
      row = row[:max_src_len - 1] + [EOS]
    ids.append(row)
  width = width or -(-max(len(r) for r in ids) // 8) * 8
  return np.array([r + [0] * (width - len(r)) for r in ids], np.int32)


class BleuEval:
  """Greedy-decodes a fixed sample of sentence pairs and scores it with sacreBLEU; used by the
  training loop at every evaluation."""

  def __init__(self, model: Transformer, tokenizers: Tokenizers, pairs: list[tuple[str, str]],
               max_len: int, batch_size: int):
    self.tokenizers, self.pairs = tokenizers, pairs
    sources = [p[0] for p in pairs]
    src = encode_sources(tokenizers.src, sources, max_len, width=max_len)
    rows = -(-len(src) // batch_size) * batch_size
    src = np.concatenate([src, np.repeat(src[:1], rows - len(src), axis=0)])  # Full batches.
    self.batches = src.reshape(-1, batch_size, max_len)
    self._generate = jax.jit(functools.partial(generate, model, max_len=max_len))

  def __call__(self, params) -> tuple[float, list[str]]:
    """-> (BLEU, a few 'source => output [reference]' lines)."""
    # process_allgather: with several hosts the output is a global array.
    tokens = np.concatenate([multihost_utils.process_allgather(self._generate(params, b),
                                                               tiled=True)
                             for b in self.batches])
    hyps = [self.tokenizers.tgt.decode(decode.strip(t)) for t in tokens[:len(self.pairs)]]
    examples = [f"{src} => {hyp} [{ref}]" for (src, ref), hyp in zip(self.pairs[:5], hyps)]
    return corpus_bleu(hyps, [p[1] for p in self.pairs])[0], examples


class Translator:
  """Restores a workdir's model and tokenizer and translates batches of sentences."""

  def __init__(self, workdir: str | Path, step: int | None = None):
    workdir = Path(workdir)
    config_path = workdir / "config.json"
    if not config_path.exists():
      raise InferenceError(f"{workdir} holds no config.json: not a training workdir")
    self.config = ml_collections.ConfigDict(json.loads(config_path.read_text()))
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
    self.step = ckpt.latest_step() if step is None else step
    if self.step is None:
      raise InferenceError(f"no checkpoint in {ckpt_dir}")
    mesh = sharding.make_mesh((-1, 1, 1))
    self.params = ckpt.restore_params(self.step, self._abstract_params(), mesh)
    self.max_src_len = int(self.config.max_len)
    logging.info("Restored step %d from %s", self.step, ckpt_dir)

  def _abstract_params(self):
    dummy = jnp.ones((1, 2), jnp.int32)
    boxed = jax.eval_shape(self.model.init, jax.random.PRNGKey(0), dummy, dummy)["params"]
    return boxed  # Still boxed: the checkpointer turns the names into shardings.

  @functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
  def generate_ids(self, params, src, max_len, beam_size, alpha):
    """src [B, S] -> best output tokens [B, max_len]; compiled once per shape and options."""
    return generate(self.model, params, src, max_len, beam_size, alpha)

  def translate(self, sentences: list[str], options: DecodeOptions = DecodeOptions()) -> list[str]:
    src = encode_sources(self.tokenizers.src, sentences, self.max_src_len)
    max_len = options.max_len or src.shape[1] + options.max_len_margin
    tokens = np.asarray(self.generate_ids(self.params, src, max_len, options.beam_size,
                                       options.alpha))
    return [self.tokenizers.tgt.decode(decode.strip(row)) for row in tokens]
