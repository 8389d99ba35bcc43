"""What every decoding command shares and imports without loading jax: its error, and the
options of a decoding (beam, length penalty, lengths)."""

from __future__ import annotations

import dataclasses

from transformer_jax.errors import UserError


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
