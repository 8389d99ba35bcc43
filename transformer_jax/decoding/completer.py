"""A trained language model restored from a workdir (config, tokenizer, the newest checkpoint
that verifies), continuing text prompts with one jitted decoder (prompts.continue_prompts).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.tokenizer import BOS, EOS
from transformer_jax.decoding import search
from transformer_jax.runs import restore
from transformer_jax.decoding.options import InferenceError
from transformer_jax.decoding.prompts import continue_prompts


class Completer:
  """Restores a workdir's language model and continues prompts."""

  def __init__(self, workdir: str | Path, step: int | None = None, ema: bool = True,
               command: str = "generate"):
    run = restore.restore(workdir, "decoder_only", command, step, ema)
    self.model, self.step, self.params, self.config = run.model, run.step, run.params, run.config
    self.tokenizer, self.max_len = run.tokenizers.tgt, run.config.data.max_len

  @functools.partial(jax.jit, static_argnums=(0, 4, 5))
  def _continue(self, params, prompts, lengths, max_new, sampler, rng):
    return continue_prompts(self.model, params, prompts, lengths, self.max_len, max_new,
                            sampler, rng, vocab=self.tokenizer.vocab_size)

  def encode(self, prompts: list[str]) -> list[list[int]]:
    """<bos> + each prompt's ids; a prompt that leaves no room to generate is an error."""
    rows = []
    for number, (text, ids) in enumerate(zip(prompts, self.tokenizer.encode(prompts)), 1):
      if len(ids) + 1 >= self.max_len:
        raise InferenceError(f"prompt {number} has {len(ids)} tokens: the model reads at most "
                             f"{self.max_len - 2} (data.max_len={self.max_len}, with <bos> and "
                             "one new token)")
      rows.append([BOS] + list(ids))
    return rows

  def complete(self, prompts: list[str], max_new_tokens: int, sampler=search.Greedy(),
               seed: int = 0) -> list[str]:
    """Each prompt's continuation as text (up to <eos>, `max_new_tokens` or the model's
    max_len, whichever comes first). With a seed, prompt i of the list draws the same text
    whatever the other prompts are."""
    if max_new_tokens < 1:
      raise InferenceError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
    top_k, vocab = getattr(sampler, "top_k", 0), self.tokenizer.vocab_size
    if top_k > vocab:
      raise InferenceError(f"--top_k {top_k} is over the run's vocabulary of {vocab} tokens "
                           "(data.vocab_size): 0 samples from all of them")
    rows = self.encode(prompts)
    width = -(-max(map(len, rows)) // 8) * 8  # Few distinct shapes, few compilations.
    prompts_ids = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    lengths = np.array([len(r) for r in rows], np.int32)
    # No row can take more than the model's positions past its prompt (the loop's own limit):
    # asking for more allocates nothing more.
    max_new_tokens = min(max_new_tokens, self.max_len - int(lengths.min()))
    tokens = np.asarray(self._continue(self.params, jnp.asarray(prompts_ids),
                                       jnp.asarray(lengths), max_new_tokens, sampler,
                                       jax.random.PRNGKey(seed)))
    out = []
    for row in tokens:
      ids = row.tolist()
      out.append(self.tokenizer.decode(ids[:ids.index(EOS)] if EOS in ids else ids))
    return out
