"""Predicts the tokens behind each [MASK] of texts with a masked language model (encoder-only).

  python -m transformer_jax fill --workdir runs/mlm_shakespeare "To be or not to [MASK]."
  python -m transformer_jax fill --workdir runs/mlm_shakespeare --input texts.txt --top_k 3

Each mask stands for one piece of the run's tokenizer. For each text, each mask's `--top_k`
likeliest pieces are printed with their probabilities (or written, with `--output`, one JSON
object a line: {"text", "masks": [[[piece, probability], ...], ...]}). In a text, "\\n" stands
for a newline.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402

from absl import app, flags  # noqa: E402

from transformer_jax import errors, fs  # noqa: E402
from transformer_jax.commands import launch  # noqa: E402
from transformer_jax.decoding.inputs import check_output_path, read_lines  # noqa: E402
from transformer_jax.decoding.options import InferenceError  # noqa: E402
from transformer_jax.runs.workdir import Workdir  # noqa: E402


def define_flags():
  flags.DEFINE_string("workdir", None, "A masked language model's training workdir.")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the newest that verifies.")
  flags.DEFINE_string("input", None, "File with one text a line; - reads standard input.")
  flags.DEFINE_string("output", None, "Where to write the predictions (JSON lines).")
  flags.DEFINE_integer("top_k", 5, "Pieces to report for each mask.")
  flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache; "
                      "default: the training run's (WORKDIR/jax_cache).")


def main(argv):
  FLAGS = flags.FLAGS
  texts = [t.replace("\\n", "\n") for t in argv[1:]]
  with errors.reported():
    if not FLAGS.workdir:
      raise InferenceError("--workdir is required")
    if bool(texts) == bool(FLAGS.input):
      raise InferenceError("give either texts as arguments or --input FILE")
    if FLAGS.top_k < 1:
      raise InferenceError(f"--top_k must be at least 1, got {FLAGS.top_k}")
    if FLAGS.input:
      texts = [t.replace("\\n", "\n") for t in read_lines(FLAGS.input)]
      if not texts:
        raise InferenceError(f"--input {FLAGS.input} holds no text")
    if FLAGS.output:
      check_output_path(FLAGS.output)
    Workdir(FLAGS.workdir).check_family("encoder_only", "fill")
    from transformer_jax.decoding.filler import MASK, Filler
    for number, text in enumerate(texts, 1):  # Before the model loads.
      if MASK not in text:
        raise InferenceError(f"text {number} holds no {MASK}: nothing to fill")
    launch.use_compilation_cache(FLAGS.workdir, FLAGS.compilation_cache_dir)
    filler = Filler(FLAGS.workdir, FLAGS.step)
    predictions = filler.fill(texts, FLAGS.top_k)
    if FLAGS.output:
      fs.replace_file(FLAGS.output, "".join(
          json.dumps({"text": t, "masks": m}, ensure_ascii=False) + "\n"
          for t, m in zip(texts, predictions)).encode("utf-8"))
      return
    for text, masks in zip(texts, predictions):
      print(text)
      for number, top in enumerate(masks, 1):
        print(f"  [MASK] {number}: " + ", ".join(f"{piece!r} {p:.3f}" for piece, p in top))


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
