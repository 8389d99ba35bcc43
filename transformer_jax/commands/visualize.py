"""Attention heatmaps of one translation, as the d2l chapter shows them.

  python -m transformer_jax visualize --workdir runs/fra_eng --out maps/ "I'm home."

One PNG per attention kind and layer (encoder self-, decoder self- and cross-attention), one
panel per head.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402

from transformer_jax import errors, fs  # noqa: E402
from transformer_jax.commands import launch
from transformer_jax.decoding.options import DecodeOptions, InferenceError  # noqa: E402


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Training workdir.")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
  flags.DEFINE_string("out", None, "Directory for the PNG files (KIND_layerN.png); one that "
                      "already holds such files is refused.")


def main(argv):
  FLAGS = flags.FLAGS
  with errors.reported():
    if len(argv) != 2 or not FLAGS.workdir or not FLAGS.out:
      raise InferenceError("usage: visualize --workdir DIR --out DIR2 \"sentence\"")
    if Path(FLAGS.out).exists() and not Path(FLAGS.out).is_dir():
      raise InferenceError(f"--out {FLAGS.out} is a file; it must name a directory")
    if not argv[1].strip():
      raise InferenceError("the sentence is empty")
    fs.check_writable(FLAGS.out, "--out")
    from transformer_jax.runs.workdir import Workdir, check_outside_runs
    check_outside_runs(FLAGS.out, "--out")  # Beside a run's files at most, not among them.
    # Each map is KIND_layerN.png: a user's files of those names are never replaced.
    if taken := sorted(p.name for p in Path(FLAGS.out).glob("*_layer*.png")):
      raise InferenceError(f"--out {FLAGS.out} already holds {', '.join(taken[:3])}"
                           f"{', ...' if len(taken) > 3 else ''}: name a new directory, or "
                           "move those away")
    Workdir(FLAGS.workdir).check_family("encoder_decoder", "visualize")
    from transformer_jax.decoding import heatmaps  # matplotlib and the model load after the checks.
    translator = heatmaps.Translator(FLAGS.workdir, FLAGS.step)
    src_tokens, tgt_tokens, maps = heatmaps.attention_maps(translator, argv[1])
    print("translation:", translator.translate([argv[1]], DecodeOptions(beam_size=1))[0])
    for path in heatmaps.plot(maps, src_tokens, tgt_tokens, Path(FLAGS.out)):
      print(path)


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
