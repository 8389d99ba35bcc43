"""Long sources translated sentence by sentence.

A model trained on sentence pairs translates a paragraph worse than each of its sentences, and
a source over the model's `max_len` tokens would lose its end to truncation. `split_long` cuts
such sources at sentence ends (pysbd's rules for the source language); the translations of the
pieces are joined again with a space.
"""

from __future__ import annotations

import functools
import re

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


def split_long(lines: list[str], lengths: list[int], over: int | None,
               lang: str) -> tuple[list[str], list[int]]:
  """Lines of more than `over` tokens (`lengths`) split into sentences; `over` None splits none.
  Returns the pieces and, for each, the index of the line it came from, in line order."""
  pieces, owners = [], []
  for i, (line, length) in enumerate(zip(lines, lengths)):
    parts = sentences(line, lang) if over is not None and length > over else [line]
    pieces += parts
    owners += [i] * len(parts)
  return pieces, owners


def join(translations: list[str], owners: list[int], num_lines: int) -> list[str]:
  """The translations of the pieces back into one line per source line."""
  out = [[] for _ in range(num_lines)]
  for text, i in zip(translations, owners):
    out[i].append(text)
  return [" ".join(t for t in parts if t) for parts in out]
