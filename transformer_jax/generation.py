"""Generation glue between the model and decode.py: encode the source once into a cache,
then decode greedily, by sampling or by beam search; source sentences to padded id arrays."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax import decode
from transformer_jax.errors import UserError
from transformer_jax.data.tokenizer import BOS, EOS, PAD
from transformer_jax.model import Transformer

SPECIALS = decode.Specials(bos=BOS, eos=EOS, pad=PAD)


class InferenceError(UserError, ValueError):
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
    tokens, _ = decode.beam_search(step, cache, src.shape[0], max_len, SPECIALS, beam_size,
                                   alpha)
    return tokens[:, 0]
  return decode.sample(step, cache, src.shape[0], max_len, SPECIALS, sampler, rng)


def encode_sources(tokenizer, sentences: list[str], max_src_len: int,
                   width: int | None = None, numbers: list[int] | None = None) -> np.ndarray:
  """Source token ids with <eos>, [B, width]; width defaults to the longest row rounded up to 8
  (few distinct shapes, few compilations). Overlong sentences are truncated with a warning;
  an empty one is an error. Messages name sentence `numbers[i]` (default: i + 1)."""
  numbers = numbers or list(range(1, len(sentences) + 1))
  ids, warned = [], set()  # A batch padded with copies of a sentence warns of it once.
  for i, row in enumerate(tokenizer.encode(sentences)):
    if not sentences[i].strip() or not row:
      raise InferenceError(f"sentence {numbers[i]} is empty")
    row = list(row) + [EOS]
    if len(row) > max_src_len:
      if (numbers[i], sentences[i]) not in warned:
        logging.warning("sentence %d has %d tokens; truncated to the model's %d", numbers[i],
                        len(row), max_src_len)
        warned.add((numbers[i], sentences[i]))
      row = row[:max_src_len - 1] + [EOS]
    ids.append(row)
  width = width or -(-max(len(r) for r in ids) // 8) * 8
  return np.array([r + [0] * (width - len(r)) for r in ids], np.int32)


def strip(tokens) -> list[int]:
  """A row of output ids up to (not including) <eos>."""
  return decode.strip(tokens, SPECIALS)
