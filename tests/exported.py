"""Helpers of the Hugging Face export tests: a workdir exported, its model run here and in
`transformers` (PyTorch, CPU, float32) on the same padded batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from tests.conftest import ROOT


def export(workdir: Path, out: Path) -> Path:
  """`export --to huggingface` in this process (the command's own errors: export_command)."""
  from transformer_jax.interop import export as export_lib
  return export_lib.export(workdir, "huggingface", out)


def export_command(workdir: Path, out: Path) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "transformer_jax", "export", "--workdir",
                         str(workdir), "--to", "huggingface", str(out)], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """Rows of ids right-padded with 0 into [B, T], and the [B, T] mask of real tokens."""
  width = max(map(len, rows))
  ids = np.array([r + [0] * (width - len(r)) for r in rows], np.int64)
  mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int64)
  return ids, mask


def our_outputs(workdir: Path, *ids: np.ndarray) -> np.ndarray:
  """The workdir's model (the parameters it decodes with) on [B, T] ids (0 = padding; a
  translation model: sources and decoder inputs): logits, float32."""
  from transformer_jax.runs import restore
  run = restore.restore(workdir)
  return np.asarray(jax.jit(run.model.apply)({"params": run.params},
                                             *(x.astype(np.int32) for x in ids)))


def their_outputs(out: Path, cls: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  import torch
  import transformers
  model = getattr(transformers, cls).from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids),
                 attention_mask=torch.from_numpy(mask)).logits.numpy()


def logit_gap(workdir: Path, out: Path, cls: str, rows: list[list[int]],
              their_rows: list[list[int]] | None = None, columns=None) -> float:
  """The largest |difference| between the workdir's outputs and the exported model's on `rows`
  of ids padded into one batch (which must hold padding), at every real position (a
  classifier's: every row). The exported model reads `their_rows` (default the same ids);
  `columns`: see `gap`."""
  ids, mask = padded(rows)
  assert len(set(map(len, rows))) > 1  # The batch holds padding.
  a = our_outputs(workdir, ids)
  b = their_outputs(out, cls, padded(their_rows or rows)[0], mask)
  return gap(a, b, mask.astype(bool), columns)


def gap(a: np.ndarray, b: np.ndarray, real: np.ndarray, columns=None) -> float:
  """max |a - b| over the [B, T] positions `real` of [B, T, V] logits ([B, labels] outputs:
  every row). `columns`: the exported model's id of each of our ids, -1 for none (a
  renumbered vocabulary); default the same ids."""
  if a.ndim == 2:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))
  if columns is not None:
    columns = np.asarray(columns)
    known = columns >= 0
    a, b = a[..., :len(columns)][..., known], b[..., columns[known]]
  return float(np.max(np.abs(a[real] - b[real])))


def with_model_field(workdir: Path, to: Path, field: str, value) -> Path:
  """A workdir's config.json and tokenizer in `to`, one model field changed: enough for the
  export's refusals, which come before any parameter is read."""
  to.mkdir()
  saved = json.loads((workdir / "config.json").read_text())
  saved["model"][field] = value
  (to / "config.json").write_text(json.dumps(saved))
  (to / "tokenizer.model").write_bytes((workdir / "tokenizer.model").read_bytes())
  return to
