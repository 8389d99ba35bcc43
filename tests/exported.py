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
  from transformer_jax.serving import export as export_lib
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
  from transformer_jax import sharding
  from transformer_jax.models import trained
  from transformer_jax.workdir import Workdir
  run = Workdir(workdir)
  config, _, model = trained.open_run(run)
  key = "ema_params" if config.step.ema_decay > 0 else "params"
  _, params = trained.read_params(run, model, sharding.make_mesh((-1, 1, 1)), key)
  return np.asarray(jax.jit(model.apply)({"params": params}, *(x.astype(np.int32) for x in ids)))


def their_outputs(out: Path, cls: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  import torch
  import transformers
  model = getattr(transformers, cls).from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids),
                 attention_mask=torch.from_numpy(mask)).logits.numpy()


def with_model_field(workdir: Path, to: Path, field: str, value) -> Path:
  """A workdir's config.json and tokenizer in `to`, one model field changed: enough for the
  export's refusals, which come before any parameter is read."""
  to.mkdir()
  saved = json.loads((workdir / "config.json").read_text())
  saved["model"][field] = value
  (to / "config.json").write_text(json.dumps(saved))
  (to / "tokenizer.model").write_bytes((workdir / "tokenizer.model").read_bytes())
  return to
