"""A vocabulary shortlist (CTranslate2's vocabulary map, Marian's lexical shortlist): for each
source piece the target pieces that most often come with it in the training pairs, and the most
frequent target pieces for every source.

The table is written in CTranslate2's vmap format, one line a source piece (`piece<TAB>target
pieces`), the always-kept pieces on the line whose key is empty; `export --to ctranslate2`
copies it into the model as vmap.txt, so both engines can decode with the same map. A target
piece t is ranked for a source piece s by P(t in the target | s in the source), counted over
the training pairs (each piece once a sentence): the pieces that come with s, not those that
come with every sentence (those are the frequent ones, kept anyway).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from absl import logging

from transformer_jax.decoding.options import InferenceError

FILE = "shortlist.tsv"  # In the workdir.
# Target pieces kept per source piece (besides the frequent ones), and the frequent target
# pieces kept for every source. On the main job's model with int8 weights, validation BLEU
# (beam 4) 43.91 against 44.01 with the whole vocabulary; 20 and 300 gave 43.66.
PER_PIECE = 50
FREQUENT = 500


def build(sources: list[list[int]], targets: list[list[int]], vocab: int,
          per_piece: int = PER_PIECE, frequent: int = FREQUENT) -> dict[int, np.ndarray]:
  """Source and target piece ids of the training pairs -> {source id: target ids}, the always
  kept ones under -1 (every array ranked best first)."""
  if len(sources) != len(targets) or not sources:
    raise InferenceError(f"a shortlist needs pairs: {len(sources)} sources, {len(targets)} "
                         "targets")
  pairs, source_counts = [], np.zeros(vocab, np.int64)
  target_counts = np.zeros(vocab, np.int64)
  for src, tgt in zip(sources, targets):
    s, t = np.unique(np.asarray(src, np.int64)), np.unique(np.asarray(tgt, np.int64))
    source_counts[s] += 1
    target_counts[t] += 1
    pairs.append((s[:, None] * vocab + t[None, :]).ravel())
  codes, counts = np.unique(np.concatenate(pairs), return_counts=True)
  s, t = codes // vocab, codes % vocab
  # Ranked by source piece, then by co-occurrence (P(t | s) orders as the count within s).
  order = np.lexsort((-counts, s))
  s, t = s[order], t[order]
  starts = np.searchsorted(s, np.arange(vocab))
  ends = np.searchsorted(s, np.arange(vocab), side="right")
  always = np.argsort(-target_counts, kind="stable")[:frequent]
  common = np.zeros(vocab, bool)
  common[always] = True
  table = {-1: always}
  for piece in np.flatnonzero(source_counts):
    ranked = t[starts[piece]:ends[piece]]
    table[int(piece)] = ranked[~common[ranked]][:per_piece]  # The frequent ones are kept anyway.
  return table


def write(table: dict[int, np.ndarray], pieces: list[str], path: Path) -> None:
  """The table in CTranslate2's vmap format (piece strings), written whole or not at all."""
  lines = [f"{'' if key == -1 else pieces[key]}\t{' '.join(pieces[i] for i in ids)}\n"
           for key, ids in sorted(table.items())]
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text("".join(lines), encoding="utf-8")
  tmp.replace(path)


def read(path: Path, pieces: list[str]) -> dict[int, np.ndarray]:
  """A vmap-format file -> {source id: target ids} (-1: always kept), with the piece strings of
  `pieces` (the shared vocabulary); an unknown piece is an error naming its line."""
  ids = {piece: i for i, piece in enumerate(pieces)}
  table = {}
  for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
    key, _, values = line.partition("\t")
    try:
      table[-1 if key == "" else ids[key]] = np.array([ids[v] for v in values.split(" ") if v],
                                                       np.int32)
    except KeyError as e:
      raise InferenceError(f"{path}:{number}: {e.args[0]!r} is no piece of the vocabulary"
                           ) from None
  if -1 not in table:
    raise InferenceError(f"{path} has no line of always-kept pieces (an empty key)")
  return table


def masks(table: dict[int, np.ndarray], vocab: int, always: tuple[int, ...]) -> np.ndarray:
  """[vocab + 1, vocab] bool: row i the target ids source id i brings (none for ids the table
  lacks), the last row the always-kept ones and `always` (the specials)."""
  out = np.zeros((vocab + 1, vocab), bool)
  for key, ids in table.items():
    out[vocab if key == -1 else key, ids] = True
  out[vocab, list(always)] = True
  return out


def for_workdir(workdir: str | Path) -> Path:
  """The workdir's shortlist file, built from its training pairs if it has none yet."""
  from transformer_jax.decoding.inputs import split_pairs
  from transformer_jax.runs.workdir import Workdir
  path = Path(workdir) / FILE
  if path.exists():
    return path
  tokenizers = Workdir(workdir).tokenizers()
  sources, targets = split_pairs(str(workdir), "train")
  logging.info("building the vocabulary shortlist from %d training pairs into %s",
               len(sources), path)
  table = build(tokenizers.src.encode(sources), tokenizers.tgt.encode(targets),
                tokenizers.tgt.vocab_size)
  try:
    write(table, tokenizers.tgt.pieces(), path)
  except OSError as e:
    raise InferenceError(f"cannot write the shortlist {path}: {e.strerror or e}") from None
  return path


class Candidates:
  """A shortlist as decoding reads it: `table` [V, P] the target ids each source id brings
  (padded with V, which selects nothing), `always` [V] bool the ids every source keeps, and
  `width`, the columns a decoder step projects onto (the union of its sources' candidates,
  ascending, padded; a union wider than that keeps its `width` lowest ids, the most frequent
  pieces of a SentencePiece vocabulary). Each search then picks among its own source's
  candidates."""

  def __init__(self, table: dict[int, np.ndarray], vocab: int, always: tuple[int, ...],
               width: int):
    if width < 1:
      raise InferenceError(f"a shortlist's width must be positive, got {width}")
    per = max((len(ids) for key, ids in table.items() if key != -1), default=1)
    self.table = np.full((vocab, per), vocab, np.int32)
    for key, ids in table.items():
      if key != -1 and key < vocab:
        self.table[key, :len(ids)] = ids
    self.always = np.zeros(vocab, bool)
    self.always[table[-1]] = True
    self.always[list(always)] = True
    self.vocab, self.width = vocab, min(width, vocab)
    digest = hashlib.sha256(self.table.tobytes() + self.always.tobytes()).hexdigest()[:16]
    self.describe = f"shortlist {digest} width {self.width}"

  def of_sources(self, src):
    """src [B, S] source ids -> [B, V] bool: each source's candidates (the always-kept ones
    among them)."""
    import jax.numpy as jnp
    cand = jnp.asarray(self.table)[src].reshape(src.shape[0], -1)  # [B, S * P]
    rows = jnp.arange(src.shape[0])[:, None]
    masks = jnp.zeros((src.shape[0], self.vocab), bool).at[rows, cand].set(True, mode="drop")
    return masks | jnp.asarray(self.always)

  def columns(self, masks):
    """masks [B, V] (`of_sources`' of a step's B sources) -> (ids [width], allowed [B, width]):
    the union's ids ascending (padded with id 0), and which of them each source's own
    candidates hold. A search picks among its own source's candidates only, so its output does
    not depend on the sources decoding beside it (unless the union overflows the width)."""
    import jax.numpy as jnp
    union = jnp.any(masks, axis=0)
    ids = jnp.nonzero(union, size=self.width, fill_value=0)[0].astype(jnp.int32)
    valid = jnp.arange(self.width) < jnp.sum(union)
    return ids, jnp.take(masks, ids, axis=1) & valid
