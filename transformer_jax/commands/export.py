"""Exports a trained workdir's model: a translation model as a CTranslate2 model or serialized
jax decoders; a model of any family as a Hugging Face `transformers` directory.

  python -m transformer_jax export --workdir runs/fra_eng --to ctranslate2 runs/fra_eng_ct2
  python -m transformer_jax export --workdir runs/fra_eng --to ctranslate2 \
      --quantization int8 runs/fra_eng_ct2_int8
  python -m transformer_jax export --workdir runs/fra_eng --to jax runs/fra_eng_jax
  python -m transformer_jax export --workdir runs/lm_shakespeare --to huggingface runs/lm_hf
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from transformer_jax import errors  # noqa: E402
from transformer_jax.commands import launch
from transformer_jax.interop.export import FORMATS, ExportError, export  # noqa: E402
from transformer_jax.runs.workdir import Workdir  # noqa: E402


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "A training workdir.")
  flags.DEFINE_enum("to", None, FORMATS, "ctranslate2: a CTranslate2 model directory; jax: "
                    "serialized jax.export decoders (greedy and beam) with their parameters; "
                    "huggingface: a transformers model directory (GPT-2, BERT or Marian).")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the newest that verifies.")
  flags.DEFINE_string("quantization", None, "ctranslate2 only: store the weights as int8, "
                      "int8_float32, int16, float16, ... (default: float32).")
  flags.DEFINE_integer("beam_size", None, "jax only: the beam size exported beside greedy "
                       "decoding; default: the workdir's config (decode.beam_size).")
  flags.DEFINE_float("alpha", None, "jax only: the beam search's length penalty; default: the "
                     "workdir's config (decode.alpha).")


def main(argv):
  FLAGS = flags.FLAGS
  with errors.reported():
    if len(argv) != 2:
      raise ExportError("name one output directory: export --workdir W --to FORMAT OUT")
    if not FLAGS.workdir or not FLAGS.to:
      raise ExportError("--workdir and --to are required")
    if FLAGS.beam_size is not None and FLAGS.beam_size < 1:
      raise ExportError(f"--beam_size must be at least 1, got {FLAGS.beam_size}")
    Workdir(FLAGS.workdir).load_config()  # A training workdir, or one line.
    out = export(FLAGS.workdir, FLAGS.to, argv[1], step=FLAGS.step,
                 quantization=FLAGS.quantization, beam_size=FLAGS.beam_size, alpha=FLAGS.alpha)
  print(f"Exported {FLAGS.workdir} to {out} ({FLAGS.to})")


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
