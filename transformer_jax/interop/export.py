"""A trained workdir's model in a form that runs without this project's model code.

  python -m transformer_jax export --workdir runs/fra_eng --to ctranslate2 runs/fra_eng_ct2
  python -m transformer_jax export --workdir runs/fra_eng --to jax runs/fra_eng_jax

  python -m transformer_jax export --workdir runs/lm_shakespeare --to huggingface runs/lm_hf

`ctranslate2`: a CTranslate2 model directory (ctranslate2.py), with the workdir's vocabulary
shortlist as its vmap.txt where it has one (decoding/shortlist.py), and the SentencePiece model
beside it (`tokenizer.model`); `huggingface`: a `transformers` model directory of any family
(huggingface.py); `jax`: `jax.export` programs of the decoder and what runs them
(jax_export.py).

Either is built in a new directory beside OUT (`.OUT.partial-XXXX`) and renamed to OUT when
complete: nothing half-written is left, and nothing that exists is cleared.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from absl import logging

from transformer_jax import fs
from transformer_jax.data.tokenizer import SPM_FILE, SentencePiece
from transformer_jax.decoding import shortlist
from transformer_jax.decoding.options import DecodeOptions
from transformer_jax.decoding.translator import Translator
from transformer_jax.errors import UserError
from transformer_jax.interop import ctranslate2, huggingface, jax_export
from transformer_jax.interop.ctranslate2 import QUANTIZATIONS
from transformer_jax.runs.workdir import MODEL_KINDS, Workdir, check_outside_runs

FORMATS = ("ctranslate2", "jax", "huggingface")


class ExportError(UserError, ValueError):
  """The workdir or output cannot be exported."""


def export(workdir: str | Path, to: str, output: str | Path, *, step: int | None = None,
           quantization: str | None = None, beam_size: int | None = None,
           alpha: float | None = None) -> Path:
  """Writes `workdir`'s model (its newest checkpoint that verifies, or `step`) in format `to`
  at `output`. `beam_size`/`alpha` (jax only): the beam search exported, default the
  workdir's decoding settings."""
  output = Path(output)
  if to not in FORMATS:
    raise ExportError(f"--to {to!r}: choose one of {', '.join(FORMATS)}")
  if quantization and to != "ctranslate2":
    raise ExportError("--quantization applies to --to ctranslate2 only")
  if quantization and quantization not in QUANTIZATIONS:
    raise ExportError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
  if output.exists():
    raise ExportError(f"{output} exists; name a new directory for the exported model")
  check_outside_runs(output)
  if alpha is not None and alpha < 0:
    raise ExportError(f"--alpha must be >= 0 (0: no length penalty), got {alpha}")
  fs.check_writable(output, "the output")
  if to == "huggingface":
    if beam_size is not None or alpha is not None:
      raise ExportError("--beam_size and --alpha apply to --to jax only")
    why = huggingface.refusal(workdir)
    if why:
      raise ExportError(f"{workdir} has no Hugging Face counterpart: {why}")
    huggingface.export(workdir, output, step)
    return output
  run = Workdir(workdir)
  if run.model_kind() != "encoder_decoder":  # Formats of translation models only.
    raise ExportError(f"{workdir} holds a {MODEL_KINDS[run.model_kind()][0]} (model.family="
                      f"{run.load_config().model.family!r}): --to {to} exports translation "
                      "models; export this one with --to huggingface")
  if to == "ctranslate2" and importlib.util.find_spec("ctranslate2") is None:
    raise ExportError("--to ctranslate2 needs CTranslate2: pip install "
                      "'.[export]' in the project's folder")
  translator = Translator(workdir, step, ema=True)
  if not isinstance(translator.tokenizers.src, SentencePiece):
    raise ExportError(f"{workdir} uses word vocabularies; export needs a SentencePiece workdir")
  with fs.new_directory(output) as partial:
    if to == "ctranslate2":
      ctranslate2.write(translator, partial, quantization)
      if (Path(workdir) / shortlist.FILE).exists():  # CTranslate2's vocabulary map (use_vmap).
        shutil.copyfile(Path(workdir) / shortlist.FILE, partial / ctranslate2.VMAP_FILE)
    else:
      decode = translator.config.decode
      jax_export.write(translator, partial, beam_size or decode.beam_size,
                       decode.alpha if alpha is None else alpha, DecodeOptions.max_len_margin)
    (partial / SPM_FILE).write_bytes(translator.tokenizers.src.model_proto)
  logging.info("Exported step %s of %s to %s (%s)", translator.step, workdir, output, to)
  return output
