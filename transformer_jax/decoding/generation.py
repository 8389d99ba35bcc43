"""Translation glue between the encoder-decoder model and search.py: encode the source once
into a cache, then decode greedily, by sampling or by beam search; source sentences to padded
id arrays. (A language model's prompts: prompts.py; the options and error: options.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from transformer_jax.decoding import platforms, search, slots
from transformer_jax.data.tokenizer import BOS, EOS, PAD
from transformer_jax.models.transformer import Transformer

SPECIALS = search.Specials(bos=BOS, eos=EOS, pad=PAD)


# The axis of positions in the model's self-attention caches ([rows, N, L, H], or [rows, layers,
# N, L, H] for a scanned stack: Decoder.init_cache).
CACHE_POSITIONS = -2


def encode_source(model: Transformer, params, src):
  """src [B, S] -> the source's decoding state (encoder run once, every layer's cross-attention
  keys and values computed once): Transformer.source_state."""
  segments = (src != 0).astype(jnp.int32)
  memory = model.apply({"params": params}, src, segments, method=Transformer.encode)
  return model.apply({"params": params}, memory, segments, method=Transformer.source_state)


def _members(model, params) -> tuple[tuple[Transformer, ...], tuple]:
  """One model and its parameters, or an ensemble: sequences of both."""
  if isinstance(model, Transformer):
    return (model,), (params,)
  return tuple(model), tuple(params)


def decoder(model, params, src, max_len: int, vocab: int | None = None):
  """(tokens_to_logits, cache) for search.py over the sources src [B, S], with `max_len` cached
  positions per row. `model`/`params`: one model, or sequences of models sharing a vocabulary
  (an ensemble: the step returns their log-probabilities averaged, [B*K, V]). `vocab`: the
  tokenizer's size, the ids a step may emit (default: every id of the model's)."""
  models, params = _members(model, params)
  sources = [encode_source(m, p, src) for m, p in zip(models, params)]
  caches = tuple(m.apply({"params": p}, src.shape[0], max_len, method=Transformer.init_cache)
                 for m, p in zip(models, params))

  def step(i, tokens, cache):
    logits, cache = models[i].apply({"params": params[i]}, tokens, cache, sources[i],
                                    method=Transformer.decode_step)
    return search.tokens_only(logits, vocab), cache

  if len(models) == 1:
    return functools.partial(step, 0), caches[0]

  def ensemble_step(tokens, caches):
    logits, caches = zip(*(step(i, tokens, c) for i, c in enumerate(caches)))
    logp = sum(jax.nn.log_softmax(x) for x in logits) / len(logits)  # [B*K, V]
    return logp, tuple(caches)
  return ensemble_step, caches


def slot_model(model, vocab: int | None = None, shortlist=None) -> slots.SlotModel:
  """The slots' view (slots.SlotModel) of one model or an ensemble (a sequence of models
  sharing a vocabulary: log-probabilities averaged, as `decoder`); `params` then a sequence.
  `vocab`: the ids a step may emit, as `decoder`'s. `shortlist` (shortlist.Candidates): each
  step projects onto the union of its sources' candidates only (search.Shortlisted), each
  search choosing among its own source's."""
  models = (model,) if isinstance(model, Transformer) else tuple(model)
  ensemble = not isinstance(model, Transformer)
  members = lambda params: params if ensemble else (params,)

  def step(params, tokens, caches, sources, index):
    ids = allowed = None
    if shortlist is not None:
      ids, allowed = shortlist.columns(sources[0]["shortlist"])  # [C], [searches, C]
      allowed = jnp.repeat(allowed, tokens.shape[0] // allowed.shape[0], axis=0)  # Beams' rows.
    logits, new = [], []
    for m, p, cache, source in zip(models, members(params), caches, sources):
      source = {key: source[key] for key in ("k", "v", "valid")}
      x, cache = m.apply({"params": p}, tokens, {"index": index, **cache}, source, ids,
                         method=Transformer.decode_step)
      logits.append(search.tokens_only(x, None if ids is not None else vocab))
      new.append({"k": cache["k"], "v": cache["v"]})
    out = (logits[0] if len(models) == 1
           else sum(jax.nn.log_softmax(x) for x in logits) / len(logits))
    if shortlist is not None:
      out = search.Shortlisted(jnp.where(allowed, out, search.NEG_INF), ids)
    return out, tuple(new)

  def init_cache(params, rows, max_len):
    caches = (m.apply({"params": p}, rows, max_len, method=Transformer.init_cache)
              for m, p in zip(models, members(params)))
    return tuple({"k": c["k"], "v": c["v"]} for c in caches)

  def encode(params, src, width):
    def padded(state):  # Source positions are the next-to-last axis of k, v; the last of valid.
      pad = lambda x, axis: jnp.pad(x, [(0, 0)] * (x.ndim + axis) + [(0, width - src.shape[1])]
                                    + [(0, 0)] * (-axis - 1))
      return {"k": jax.tree.map(lambda x: pad(x, -2), state["k"]),
              "v": jax.tree.map(lambda x: pad(x, -2), state["v"]), "valid": pad(state["valid"], -1)}
    states = [padded(encode_source(m, p, src)) for m, p in zip(models, members(params))]
    if shortlist is not None:
      states[0]["shortlist"] = shortlist.of_sources(src)
    return tuple(states)

  return slots.SlotModel(step=step, init_cache=init_cache, encode=encode,
                         describe=repr((tuple(m.cfg for m in models), vocab,
                                        shortlist and shortlist.describe)),
                         cache_positions=CACHE_POSITIONS)


def translate_ids(model, params, src, max_len: int, beam_size: int = 1, alpha: float = 0.6,
                  sampler=search.Greedy(), rng=None, row_copy: str | None = None):
  """src [B, S] -> tokens [B, max_len] (best beam), jit-able with static max_len/beam_size.
  `model`/`params`: one model or an ensemble (see `decoder`). `row_copy`: as `beams`'."""
  if beam_size > 1:
    return beams(model, params, src, max_len, beam_size, alpha, row_copy=row_copy)[0][:, 0]
  step, cache = decoder(model, params, src, max_len)
  return search.sample(step, cache, src.shape[0], max_len, SPECIALS, sampler, rng)


def beams(model, params, src, max_len: int, beam_size: int, alpha: float, limits=None,
          beam_stop: str = "exact", vocab: int | None = None, row_copy: str | None = None):
  """src [B, S] -> (tokens [B, K, max_len], scores [B, K]): every beam, best first, scored by
  log-probability / GNMT length penalty (search.beam_search; `limits` [B]: each sentence's
  own length limit, at most max_len; `beam_stop`: when a search ends; `vocab`: the ids it may
  emit, as `decoder`'s; `row_copy`: how moved beams' cache rows are copied, default the
  platform's, platforms.py)."""
  step, cache = decoder(model, params, src, max_len, vocab)
  return search.beam_search(step, cache, src.shape[0], max_len, SPECIALS, beam_size, alpha,
                            limits, beam_stop, positions_axis=CACHE_POSITIONS,
                            copy=row_copy or platforms.settings(jax.default_backend()).row_copy)


def scored(model, params, src, max_len: int, beam_size: int, alpha, limits=None,
           beam_stop: str = "exact", vocab: int | None = None):
  """src [B, S] -> (tokens [B, K, max_len], scores [B, K]), K = beam_size: the beams best first
  (search.beam_search), or with K = 1 the greedy output. A score is the log-probability /
  GNMT length penalty of the output's length with <eos>, for greedy outputs too. `alpha` may
  be traced (one compilation serves every alpha). `limits` [B]: each row's own length limit
  (at most max_len); a row decodes as it would alone with max_len = its limit. `vocab`: the
  ids it may emit, as `decoder`'s."""
  if beam_size > 1:
    return beams(model, params, src, max_len, beam_size, alpha, limits, beam_stop, vocab)
  step, cache = decoder(model, params, src, max_len, vocab)
  tokens, logprob = search.sample_scored(step, cache, src.shape[0], max_len, SPECIALS,
                                         limits=limits)
  length = jnp.sum(tokens != PAD, axis=-1)  # [B]: the tokens with <eos>
  return tokens[:, None], (logprob / search.length_penalty(length, alpha))[:, None]


def sequence_logprob(model: Transformer, params, src, tgt, vocab: int | None = None):
  """Teacher-forced log-probabilities of outputs: src [B, S], tgt [B, T] output ids (with
  <eos> where an output ended), then <pad> -> [B] float32, the sum over the non-pad tokens;
  each step's distribution over the first `vocab` ids (default: all), as `decoder`'s."""
  tgt_in = jnp.concatenate([jnp.full_like(tgt[:, :1], BOS), tgt[:, :-1]], axis=1)
  logits = model.apply({"params": params}, src, tgt_in)  # [B, T, V]
  logits = search.tokens_only(logits, vocab)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], axis=-1)[..., 0]
  return jnp.sum(jnp.where(tgt != PAD, logp, 0.0), axis=-1)


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
  return search.strip(tokens, SPECIALS)
