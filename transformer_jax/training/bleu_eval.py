"""BLEU during training: a fixed sample of validation pairs, greedy-decoded and scored with
sacreBLEU at every evaluation, on every host alike."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax.data.tokenizer import Tokenizers
from transformer_jax.decoding.generation import encode_sources, strip, translate_ids
from transformer_jax.metrics import corpus_bleu
from transformer_jax.models.transformer import Transformer


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
    self._translate = jax.jit(functools.partial(translate_ids, model, max_len=max_len))

  def __call__(self, params) -> tuple[float, list[str]]:
    """-> (BLEU, a few 'source => output [reference]' lines)."""
    # process_allgather: with several hosts the output is a global array.
    tokens = np.concatenate([multihost_utils.process_allgather(self._translate(params, b),
                                                               tiled=True)
                             for b in self.batches])
    hyps = [self.tokenizers.tgt.decode(strip(t)) for t in tokens[:len(self.pairs)]]
    examples = [f"{src} => {hyp} [{ref}]" for (src, ref), hyp in zip(self.pairs[:5], hyps)]
    return corpus_bleu(hyps, [p[1] for p in self.pairs])[0], examples
