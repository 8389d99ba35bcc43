"""Translates with a model exported by `export --to jax`: jax, NumPy and SentencePiece only.

  from transformer_jax.serving.exported import ExportedTranslator
  ExportedTranslator("runs/fra_eng_jax").translate(["I lost."], beam=True)

Nothing else of this project is imported (no model code, no flax): the directory holds the
serialized decoder programs (`jax.export`), their parameters and the tokenizer, described by
export.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import sentencepiece as spm


class ExportedTranslator:
  """The decoders of an exported model directory (see transformer_jax.serving.export)."""

  def __init__(self, directory: str | Path):
    directory = Path(directory)
    manifest_file = directory / "export.json"
    if not manifest_file.is_file():
      raise FileNotFoundError(f"{directory} holds no export.json: not an exported model")
    self.manifest = json.loads(manifest_file.read_text())
    with np.load(directory / self.manifest["params"]) as saved:
      self.params = [saved[k] for k in sorted(saved.files)]
    self.tokenizer = spm.SentencePieceProcessor(
        model_file=str(directory / self.manifest["tokenizer"]))
    self.programs = {(p["beam_size"] > 1, p["width"]):
                     jax.export.deserialize((directory / p["file"]).read_bytes())
                     for p in self.manifest["programs"]}
    self.widths = sorted({width for _, width in self.programs})

  def translate(self, sentences: list[str], beam: bool = False) -> list[str]:
    """Greedy (or the exported beam search's) translations; a source longer than the widest
    program is truncated to it (ending with <eos>)."""
    if not sentences:
      return []
    eos, pad = self.manifest["eos"], self.manifest["pad"]
    rows = [ids + [eos] for ids in self.tokenizer.encode(list(sentences))]
    widest = self.widths[-1]
    rows = [r if len(r) <= widest else r[:widest - 1] + [eos] for r in rows]
    width = next(w for w in self.widths if w >= max(len(r) for r in rows))
    src = np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)  # [B, width]
    tokens = np.asarray(self.programs[beam, width].call(self.params, src))  # [B, max_len]
    out = []
    for row in tokens.tolist():
      ids = row[:row.index(eos)] if eos in row else row
      out.append(self.tokenizer.decode([i for i in ids if i > eos]))
    return out
