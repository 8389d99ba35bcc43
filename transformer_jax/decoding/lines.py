"""Translating many lines with a Translator, as `translate` and the benchmarks do: batches of
lines of similar length (one compiled shape per width) or decoding slots, long lines split into
sentences or pieces that fit the model (split_to_fit, which `serve` shares), n-best lists."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import tqdm
from absl import logging

from transformer_jax.decoding import sentences
from transformer_jax.decoding.generation import encode_sources, strip
from transformer_jax.decoding.options import DecodeOptions
from transformer_jax.decoding.translator import Translator


def translate_lines(translator: Translator, lines: list[str], options: DecodeOptions,
                    batch_size: int, progress: bool = True, segment_over: int | None = None,
                    long_beam: tuple[int, int] | None = None, batch_tokens: int = 0,
                    num_slots: int = 0) -> list[str]:
  """Translates many sentences, batched by similar length (or, with `num_slots`, streamed
  through that many decoding slots, longest first), in the input order; an empty (or
  blank) line translates to an empty line. A line of more than `segment_over` tokens (with
  <eos>) is translated sentence by sentence (sentences.py; None: no line is split), and a
  piece over the model's max_len in pieces that fit (split_to_fit): nothing is truncated.
  `long_beam` = (over, beam size): a line (or sentence of a split line) of more than `over`
  tokens is decoded with that beam size instead of `options.beam_size`."""
  pieces, owners = split_to_fit(translator, lines, segment_over)
  numbers = [i + 1 for i in owners]
  groups = [(range(len(pieces)), options)]
  if long_beam is not None:
    over, beam_size = long_beam
    is_long = [n > over for n in _token_lengths(translator, pieces)]
    groups = [([i for i, x in enumerate(is_long) if not x], options),
              ([i for i, x in enumerate(is_long) if x],
               dataclasses.replace(options, beam_size=beam_size))]
  translations = _translate_each(translator, pieces, groups, batch_size, progress, numbers,
                                 batch_tokens=batch_tokens, num_slots=num_slots)
  return sentences.join(translations, owners, len(lines))


def split_to_fit(translator: Translator, lines: list[str], segment_over: int | None
                 ) -> tuple[list[str], list[int]]:
  """The pieces `translate` and `serve` decode for `lines`, and the line each came from: a line
  of more than `segment_over` tokens cut into sentences (None: none), and any piece over the
  model's max_len cut to fit (sentences.split_long), with a warning counting such lines."""
  lengths, limit = _token_lengths(translator, lines), translator.max_src_len
  over = sum(n > limit for n in lengths)
  if over:
    logging.warning("%d of %d sources have more tokens than the model's %d (data.max_len): "
                    "each is translated in pieces cut at clauses, else between words", over,
                    len(lines), limit)
  return sentences.split_long(lines, lengths, segment_over, translator.src_lang, limit,
                              lambda texts: _token_lengths(translator, texts))


def _token_lengths(translator: Translator, lines: list[str]) -> list[int]:
  """Source tokens of each line, with <eos>."""
  return [len(ids) + 1 for ids in translator.tokenizers.src.encode(lines)]


def n_best_lines(translator: Translator, lines: list[str], n: int, options: DecodeOptions,
                 batch_size: int, progress: bool = True, batch_tokens: int = 0,
                 num_slots: int = 0) -> list[list[tuple[float, str]]]:
  """The `n` best beams (score, translation) of every line, best first, in the input order;
  each line is translated whole (no sentence splitting); a blank line gets an empty list."""
  translate = lambda texts, options, numbers: translator.n_best(texts, n, options, numbers)
  return _translate_each(translator, lines, [(range(len(lines)), options)], batch_size, progress,
                         translate=translate, empty=[], batch_tokens=batch_tokens,
                         num_slots=num_slots, n_best=n)


# Beam search's batches hold this many times greedy's decoder rows: a search runs most of its
# steps for every sentence, so larger batches waste less there than greedy's, whose rows end
# at different steps (on the Tatoeba sources, 2 was the fastest of 1, 2, 3 and 4 with beam 4:
# docs/translating.md).
BEAM_BUDGET = 2


def batch_rows(width: int, beam_size: int, batch_size: int, batch_tokens: int) -> int:
  """The sentences of a batch of sources of this width (tokens, a multiple of 8): `batch_size`,
  or with `batch_tokens` as many as fit that many decoder rows x source tokens, at most
  `batch_size`; beams count as rows, and beam search gets BEAM_BUDGET times the budget."""
  if not batch_tokens:
    return batch_size
  budget = batch_tokens * (BEAM_BUDGET if beam_size > 1 else 1)
  return max(1, min(batch_size, budget // (width * beam_size)))


def _translate_each(translator: Translator, lines: list[str],
                    groups: list[tuple[Sequence[int], DecodeOptions]], batch_size: int,
                    progress: bool, numbers: list[int] | None = None, translate=None,
                    empty="", batch_tokens: int = 0, num_slots: int = 0, n_best: int = 0) -> list:
  """Translates the lines of each group (their indices) with the group's options, in batches
  of lines of similar token length: one batch shape per source width (a multiple of 8), so
  one compilation each, of `batch_rows` lines.
  `numbers`: each line's number in warnings (default: its index + 1). `translate(texts,
  options, numbers)`: what a batch gives (default: Translator.translate); `empty`: the result
  of a blank line."""
  numbers = numbers or list(range(1, len(lines) + 1))
  if num_slots:
    return _translate_in_slots(translator, lines, groups, num_slots, progress, numbers, empty,
                               n_best)
  translate = translate or translator.translate
  lengths = [min(n, translator.max_src_len) for n in _token_lengths(translator, lines)]
  batches = []
  for indices, options in groups:
    order = sorted((i for i in indices if lines[i].strip()), key=lambda i: lengths[i])
    width_of = lambda i: -(-lengths[i] // 8) * 8
    for width, members in itertools.groupby(order, key=width_of):
      members = list(members)
      rows = batch_rows(width, options.beam_size, batch_size, batch_tokens)
      batches += [(members[i:i + rows], options, rows) for i in range(0, len(members), rows)]
  out = [empty] * len(lines)
  for batch, options, rows in tqdm.tqdm(batches, desc="translating", unit="batch",
                                        disable=not progress):
    # Pad the batch to a full one so that every batch of a width shares the compiled shape.
    texts = [lines[i] for i in batch]
    pad = rows - len(batch)
    results = translate(texts + texts[:1] * pad, options,
                        [numbers[i] for i in batch] + [numbers[batch[0]]] * pad)
    for i, result in zip(batch, results):
      out[i] = result
  return out


def _translate_in_slots(translator: Translator, lines: list[str],
                        groups: list[tuple[Sequence[int], DecodeOptions]], num_slots: int,
                        progress: bool, numbers: list[int], empty, n_best: int) -> list:
  """_translate_each through `num_slots` decoding slots: each group's lines streamed through
  them longest first. With `n_best`, each line's n best (score, translation), else its best
  translation."""
  out = [empty] * len(lines)
  tgt = translator.tokenizers.tgt
  if not n_best:  # Only the best output's text is given: greedy searches skip their scores.
    groups = [(indices, dataclasses.replace(options, scores=False))
              for indices, options in groups]
  with tqdm.tqdm(total=sum(1 for i, _ in enumerate(lines) if lines[i].strip()),
                 desc="translating", unit="sentence", disable=not progress) as bar:
    for indices, options in groups:
      indices = [i for i in indices if lines[i].strip()]
      if not indices:
        continue
      src = encode_sources(translator.tokenizers.src, [lines[i] for i in indices],
                           translator.max_src_len, numbers=[numbers[i] for i in indices])
      rows = [row[row != 0] for row in src]
      results = translator.decode_slots(rows, options, num_slots, progress=bar.update)
      for i, (tokens, scores) in zip(indices, results):
        if n_best:
          out[i] = [(float(scores[j]), tgt.decode(strip(tokens[j]))) for j in range(n_best)]
        else:
          out[i] = tgt.decode(strip(tokens[0]))
  return out
