"""Generation glue between the model and search.py: encode the source once into a cache,
then decode greedily, by sampling or by beam search; source sentences to padded id arrays.
A language model continues prompts (`continue_prompts`: the prompts read in one pass)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax

from transformer_jax.decoding import platforms, search, slots
from transformer_jax.errors import UserError
from transformer_jax.data.tokenizer import BOS, EOS, PAD, UNK
from transformer_jax.models.transformer import LanguageModel, Transformer

SPECIALS = search.Specials(bos=BOS, eos=EOS, pad=PAD)


class InferenceError(UserError, ValueError):
  """The workdir, checkpoint or input cannot be used."""


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  beam_size: int = 1  # 1: greedy (or sampling, with a sampler).
  alpha: float = 0.6  # GNMT length penalty, beam search only.
  max_len_margin: int = 10  # Decode up to source length + margin tokens ...
  max_len: int = 0  # ... or exactly this many, when positive.
  beam_stop: str = "first_k"  # When a beam search ends: search.BEAM_STOPS.
  # Whether decoding slots compute greedy outputs' scores (their log-probabilities, a
  # log-softmax over the vocabulary at every step); without, the scores are 0. Beam search
  # ranks its beams by them and always computes them.
  scores: bool = True


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


def _tokens_only(logits, vocab: int | None):
  """Logits [..., V] cut to the tokenizer's `vocab` ids (None: all): the model's vocabulary is
  padded (build.padded_vocab), and its extra ids are no tokens."""
  return logits if vocab is None else logits[..., :vocab]


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
    return _tokens_only(logits, vocab), cache

  if len(models) == 1:
    return functools.partial(step, 0), caches[0]

  def ensemble_step(tokens, caches):
    logits, caches = zip(*(step(i, tokens, c) for i, c in enumerate(caches)))
    logp = sum(jax.nn.log_softmax(x) for x in logits) / len(logits)  # [B*K, V]
    return logp, tuple(caches)
  return ensemble_step, caches


def slot_model(model, vocab: int | None = None) -> slots.SlotModel:
  """The slots' view (slots.SlotModel) of one model or an ensemble (a sequence of models
  sharing a vocabulary: log-probabilities averaged, as `decoder`); `params` then a sequence.
  `vocab`: the ids a step may emit, as `decoder`'s."""
  models = (model,) if isinstance(model, Transformer) else tuple(model)
  ensemble = not isinstance(model, Transformer)
  members = lambda params: params if ensemble else (params,)

  def step(params, tokens, caches, sources, index):
    logits, new = [], []
    for m, p, cache, source in zip(models, members(params), caches, sources):
      x, cache = m.apply({"params": p}, tokens, {"index": index, **cache}, source,
                         method=Transformer.decode_step)
      logits.append(_tokens_only(x, vocab))
      new.append({"k": cache["k"], "v": cache["v"]})
    if len(models) == 1:
      return logits[0], tuple(new)
    return sum(jax.nn.log_softmax(x) for x in logits) / len(logits), tuple(new)

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
    return tuple(padded(encode_source(m, p, src)) for m, p in zip(models, members(params)))

  return slots.SlotModel(step=step, init_cache=init_cache, encode=encode,
                         describe=repr((tuple(m.cfg for m in models), vocab)),
                         cache_positions=CACHE_POSITIONS)


def generate(model, params, src, max_len: int, beam_size: int = 1, alpha: float = 0.6,
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
  logits = _tokens_only(logits, vocab)
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


# Ids a language model's continuation never holds: padding, a sequence's start and the unknown
# piece (decoded as " ⁇ ") stand for no text a prompt could go on with.
NEVER_CONTINUED = (PAD, BOS, UNK)


def continue_prompts(model: LanguageModel, params, prompts, lengths, total_len: int,
                     max_new: int, sampler=search.Greedy(), rng=None, items=None,
                     vocab: int | None = None):
  """A language model's continuations of prompts: the prompts read in one pass, then a
  `lax.while_loop` of decoder steps, over a preallocated cache of `total_len` positions.

  Args:
    prompts: [B, P] ids, each row <bos> + a prompt's tokens, then padding (P <= total_len).
    lengths: [B] each row's prompt length with <bos> (at least 1).
    total_len: the cache's positions (the model's max_len at most: learned positions).
    max_new: tokens to generate at most per row; a row also stops at <eos> or at total_len.
    items: [B] each prompt's number in the input (default 0, 1, ...).
    vocab: the tokenizer's vocabulary size: ids from it on (the model's vocabulary padded to a
      multiple of 128) are never chosen. Default: every id of the model's.
  Returns:
    tokens [B, max_new]: each row's continuation, <pad> after its <eos> or its end. No row
    ever chooses <pad>, <bos> or <unk> (NEVER_CONTINUED): they stand for no text.

  One pass over the [B, P] prompts writes their keys and values and draws each row's first
  new token from the logits at its last prompt position (a row's padding computes what no
  one reads: the steps after write over it before they attend to it). Then every row steps at
  its own position, lengths[r] - 1 + i for its i-th new token. The i-th new token of prompt
  number n draws with the key search.row_keys(rng, n, i): a prompt continues alike in any
  batch.
  """
  rng = jax.random.PRNGKey(0) if rng is None else rng
  b = prompts.shape[0]
  items = jnp.arange(b) if items is None else items
  lengths = jnp.asarray(lengths, jnp.int32)
  # Row r's tokens reach the end of the cache after total_len - lengths[r] + 1 of them.
  limits = jnp.minimum(max_new, total_len - lengths + 1)  # [B]
  widths = cache_widths(prompts.shape[1], max_new, total_len)

  def draw(logits, i):  # logits [B, V], i: the new tokens' index -> tokens [B]
    logits = _tokens_only(logits, vocab).at[:, NEVER_CONTINUED].set(search.NEG_INF)
    return sampler(logits, search.row_keys(rng, items, i)).astype(jnp.int32)

  cache = model.apply({"params": params}, b, widths[0], method=LanguageModel.init_cache)
  logits, cache = model.apply({"params": params}, prompts, cache, lengths - 1,
                              method=LanguageModel.extend)  # [B, V] at each prompt's end
  first = draw(logits, jnp.zeros((b,), jnp.int32))
  done = (first == EOS) | (limits <= 1)
  out = jnp.full((b, max_new), PAD, jnp.int32).at[:, 0].set(first)

  def loop(state, width: int):
    """Steps while every running row's position is below `width`, the cache's positions."""
    def cond(state):
      i, _, _, done, _ = state
      fits = jnp.max(jnp.where(done, 0, lengths - 1 + i)) < width
      return (i < max_new) & ~jnp.all(done) & fits

    def body(state):
      i, cache, last, done, out = state
      # Row r feeds its new token i - 1 at position lengths[r] - 1 + i (a finished row
      # repeats the cache's last position: what it computes is not kept).
      index = jnp.minimum(lengths - 1 + i, width - 1)
      logits, cache = model.apply({"params": params}, last[:, None], {**cache, "index": index},
                                  method=LanguageModel.decode_step)  # [B, V]
      token = draw(logits, jnp.full((b,), i))
      out = out.at[:, i].set(jnp.where(done, PAD, token))
      done = done | (token == EOS) | (i >= limits - 1)
      return i + 1, cache, token, done, out

    return lax.while_loop(cond, body, state)

  state = (jnp.array(1), {**cache, "index": lengths - 1}, first, done, out)
  for width, wider in zip(widths, widths[1:] + (None,)):
    state = loop(state, width)
    if wider:  # The cache's positions grow: [..., width, H] -> [..., wider, H].
      grow = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, wider - width), (0, 0)])
      cache = state[1]
      state = (state[0], {"index": cache["index"], "k": jax.tree.map(grow, cache["k"]),
                          "v": jax.tree.map(grow, cache["v"])}, *state[2:])
  return state[4]


def cache_widths(prompt_width: int, max_new: int, total_len: int) -> tuple[int, ...]:
  """The cache's positions in `continue_prompts`, ascending: a step's attention reads every
  position of the cache, so the cache starts at the prompts' width rounded up to 64 and
  doubles as the rows go on, up to what `max_new` tokens can reach (at most total_len). On 2
  cores 16 rows stepped in 5.8 ms over 128 positions, 12.4 ms over 512."""
  need = min(total_len, prompt_width + max_new)
  widths = [min(total_len, -(-prompt_width // 64) * 64)]
  while widths[-1] < need:
    widths.append(min(total_len, 2 * widths[-1]))
  return tuple(widths)
