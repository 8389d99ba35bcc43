"""Labels texts with a fine-tuned classifier (encoder-only); with --labels, scores it.

  python -m transformer_jax classify --workdir runs/genre_shakespeare --input passages.txt
  python -m transformer_jax classify --workdir runs/genre_shakespeare --input passages.txt \
      --labels genres.txt
  python -m transformer_jax classify --workdir runs/genre_shakespeare --split test

`--input` holds one text a line ("\\n" in a line stands for a newline; - reads standard input);
each text's likeliest label is printed, one a line (or written, with `--output`, one JSON object
a line: {"text", "label", "probabilities": {label: p}}). `--labels` holds each text's true label,
one a line: the accuracy is printed after the labels (on standard error), beside that of always
guessing the most frequent true label. `--split` reads the texts and their labels from a split
of the workdir's own dataset (its config.json's dataset, data_dir and tfds_dir) instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from absl import app, flags  # noqa: E402

from transformer_jax import errors, fs  # noqa: E402
from transformer_jax.commands import launch  # noqa: E402
from transformer_jax.decoding.inputs import check_output_path, read_lines  # noqa: E402
from transformer_jax.decoding.options import InferenceError  # noqa: E402
from transformer_jax.runs.workdir import Workdir  # noqa: E402


def define_flags():
  flags.DEFINE_string("workdir", None, "A fine-tuned classifier's training workdir.")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the newest that verifies.")
  flags.DEFINE_string("input", None, "File with one text a line; - reads standard input.")
  flags.DEFINE_string("labels", None, "File with each text's true label, one a line: report "
                      "the accuracy.")
  flags.DEFINE_string("split", None, "Classify this split of the workdir's dataset (e.g. test) "
                      "and report the accuracy.")
  flags.DEFINE_string("output", None, "Where to write the predictions (JSON lines).")
  flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache; "
                      "default: the training run's (WORKDIR/jax_cache).")


def _checked_truth(path: str, texts: int, known: tuple[str, ...]) -> list[str]:
  """The true labels of --labels: one a line, as many as texts, each one the model knows."""
  truth = [line.strip() for line in read_lines(path)]
  if len(truth) != texts:
    raise InferenceError(f"--labels {path} holds {len(truth)} lines for {texts} texts: one "
                         "label a text")
  for number, label in enumerate(truth, 1):
    if label not in known:
      raise InferenceError(f"--labels {path} line {number}: {label!r} is not a label the "
                           f"classifier was trained on ({', '.join(known)})")
  return truth


def main(argv):
  FLAGS = flags.FLAGS
  with errors.reported():
    if len(argv) > 1:
      raise InferenceError(f"unexpected argument {argv[1]!r}: texts come in --input FILE")
    if not FLAGS.workdir:
      raise InferenceError("--workdir is required")
    if bool(FLAGS.input) == bool(FLAGS.split):
      raise InferenceError("give either --input FILE (one text a line; - reads standard input) "
                           "or --split NAME")
    if FLAGS.split and FLAGS.labels:
      raise InferenceError("--split scores against the split's own labels: drop --labels")
    run = Workdir(FLAGS.workdir)
    run.check_family("classifier", "classify")
    if FLAGS.split:
      from transformer_jax.decoding.inputs import split_pairs
      texts, truth = split_pairs(FLAGS.workdir, FLAGS.split)
    else:
      texts = [t.replace("\\n", "\n") for t in read_lines(FLAGS.input)]
      if not texts:
        raise InferenceError(f"--input {FLAGS.input} holds no text")
      truth = FLAGS.labels and _checked_truth(FLAGS.labels, len(texts), run.labels())
    if FLAGS.output:
      check_output_path(FLAGS.output)
    launch.use_compilation_cache(FLAGS.workdir, FLAGS.compilation_cache_dir)
    from transformer_jax.decoding.classifier import Classifier
    classifier = Classifier(FLAGS.workdir, FLAGS.step)
    probabilities = classifier.probabilities(texts)
    predicted = [classifier.labels[i] for i in probabilities.argmax(-1)]
    if FLAGS.output:
      fs.replace_file(FLAGS.output, "".join(
          json.dumps({"text": t, "label": label,
                      "probabilities": dict(zip(classifier.labels, map(float, p)))},
                     ensure_ascii=False) + "\n"
          for t, label, p in zip(texts, predicted, probabilities)).encode("utf-8"))
    else:
      print("\n".join(predicted))
    if truth:
      right = sum(p == t for p, t in zip(predicted, truth))
      common, n = collections.Counter(truth).most_common(1)[0]
      sys.stdout.flush()
      print(f"accuracy {right / len(truth):.4f} ({right} of {len(truth)}); always "
            f"{common!r}: {n / len(truth):.4f}", file=sys.stderr)


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
