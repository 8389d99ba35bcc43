"""Long sources translated sentence by sentence, and no piece longer than the model reads.

A model trained on sentence pairs translates a paragraph worse than each of its sentences, and
a source over the model's `max_len` tokens would lose its end to truncation. `split_long` cuts
such sources at sentence ends (pysbd's rules for the source language), and a sentence still
over the model's limit into clauses (after , ; : and before a dash) joined while they fit, a
clause still too long into runs of words; the translations of the pieces are joined again with
a space. pysbd is kept for sentence ends (abbreviations, quotes, numbers: a solved problem);
the clause cut is a few lines of this project's own, as no library cuts to a token budget.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pysbd
import pysbd.languages
from absl import logging


@functools.lru_cache(maxsize=None)
def _segmenter(lang: str) -> pysbd.Segmenter:
  if lang not in pysbd.languages.LANGUAGE_CODES:
    logging.info("pysbd has no sentence rules for %r; splitting with the English ones", lang)
    lang = "en"
  return pysbd.Segmenter(language=lang, clean=False)


# A text of words joined only by spaces, commas, quotes and dashes, and closed by at most one
# full stop, question or exclamation mark, is one sentence: pysbd ends sentences only at other
# characters (stops within the text, ellipses, a script's own marks, line breaks, list
# markers) or splits off quotes after the last stop. It takes pysbd about 1 ms a text to say
# so, and most long sources of a file are such texts (849 of the Tatoeba test set's 1,092
# over 16 tokens). Checked against pysbd's answers on 73,712 such texts of this project's
# corpora (docs/translating.md).
_ONE_SENTENCE = re.compile(
    r"[\w \t,'\"\u2018\u2019\u201c\u201d\u00ab\u00bb\u2013\u2014-]*\w[.!?]?")


def sentences(text: str, lang: str) -> list[str]:
  """The sentences of `text` (at least one: the text itself when it has no sentence end)."""
  stripped = text.strip()
  if _ONE_SENTENCE.fullmatch(stripped):
    return [stripped]
  pieces = [p.strip() for p in _segmenter(lang).segment(text)]
  return [p for p in pieces if p] or [text]


# Where a sentence over the model's limit is cut first: after a comma, semicolon or colon, and
# before a dash between words.
_CLAUSE_CUT = re.compile(r"(?<=[,;:])\s+|\s+(?=[-\u2013\u2014]\s)")


def _packed(parts: list[str], fits: Callable[[str], bool]) -> list[str]:
  """`parts` joined by spaces, in order, into as few pieces as `fits` allows (a part that does
  not fit alone is a piece of its own)."""
  pieces = []
  for part in parts:
    if pieces and fits(joined := f"{pieces[-1]} {part}"):
      pieces[-1] = joined
    else:
      pieces.append(part)
  return pieces


def fit(text: str, count: Callable[[str], int], limit: int) -> list[str]:
  """`text` cut into pieces of at most `limit` tokens each (`count`: a text's tokens, <eos>
  included), in order, rejoinable with spaces: clauses packed while they fit, a clause that
  does not fit cut into runs of words, a word that does not fit into runs of characters."""
  fits = lambda piece: count(piece) <= limit
  if fits(text):
    return [text]
  out = []
  for clause in _packed(_CLAUSE_CUT.split(text.strip()), fits):
    for run in ([clause] if fits(clause) else _packed(clause.split(), fits)):
      if fits(run):
        out.append(run)
        continue
      start = 0  # One word longer than the limit: the longest prefixes that fit.
      while start < len(run):
        end = start + 1
        while end < len(run) and fits(run[start:end + 1]):
          end += 1
        out.append(run[start:end])
        start = end
  return out


def split_long(lines: list[str], lengths: list[int], over: int | None, lang: str,
               limit: int | None = None, count: Callable[[list[str]], list[int]] | None = None
               ) -> tuple[list[str], list[int]]:
  """Lines of more than `over` tokens (`lengths`, <eos> included) split into sentences (`over`
  None: none), and, with a `limit`, every piece of more than `limit` tokens (`count`: the
  tokens of texts) cut to fit (`fit`). Returns the pieces and, for each, the index of the line
  it came from, in line order."""
  pieces, owners = [], []
  for i, (line, length) in enumerate(zip(lines, lengths)):
    parts = sentences(line, lang) if over is not None and length > over else [line]
    if limit is not None and length > limit:
      one = lambda text: count([text])[0]
      parts = [piece for part in parts for piece in fit(part, one, limit)]
    pieces += parts
    owners += [i] * len(parts)
  return pieces, owners


def join(translations: list[str], owners: list[int], num_lines: int) -> list[str]:
  """The translations of the pieces back into one line per source line."""
  out = [[] for _ in range(num_lines)]
  for text, i in zip(translations, owners):
    out[i].append(text)
  return [" ".join(t for t in parts if t) for parts in out]
