"""Translates with a trained workdir's latest (or given) checkpoint.

  python -m transformer_jax.translate --workdir runs/fra_eng "I lost." "I'm home."
  python -m transformer_jax.translate --workdir runs/fra_eng --beam_size 4 \
      --input test.eng --output test.hyp --reference test.fra
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys
from pathlib import Path

import tqdm
from absl import app, flags, logging

from transformer_jax import checkpoint
from transformer_jax.metrics import corpus_bleu
from transformer_jax.inference import DecodeOptions, InferenceError, Translator


def translate_lines(translator: Translator, lines: list[str], options: DecodeOptions,
                    batch_size: int, progress: bool = True) -> list[str]:
  """Translates many sentences, batched by similar length, in the input order."""
  order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
  out = [""] * len(lines)
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  for batch in tqdm.tqdm(batches, desc="translating", unit="batch", disable=not progress):
    # Pad the batch to a full one so that every batch shares the compiled shape.
    sentences = [lines[i] for i in batch]
    results = translator.translate(sentences + sentences[:1] * (batch_size - len(batch)), options)
    for i, text in zip(batch, results):
      out[i] = text
  return out


def _read_lines(path: str) -> list[str]:
  p = Path(path)
  if not p.is_file():
    raise InferenceError(f"{path} does not exist")
  return p.read_text(encoding="utf-8").splitlines()


def define_flags():
  """Command-line flags; defined only when run as a command, so importing is side-effect free."""
  flags.DEFINE_string("workdir", None, "Training workdir (config.json, tokenizer, checkpoints/).")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
  flags.DEFINE_integer("beam_size", 4, "Beam size; 1 decodes greedily.")
  flags.DEFINE_float("alpha", 0.6, "GNMT length penalty exponent (beam search).")
  flags.DEFINE_integer("max_len", 0, "Output tokens at most; 0: source length + 10.")
  flags.DEFINE_integer("batch_size", 64, "Sentences per batch with --input.")
  flags.DEFINE_string("input", None, "File with one source sentence a line.")
  flags.DEFINE_string("output", None, "Where to write the translations of --input.")
  flags.DEFINE_string("reference", None, "Reference translations of --input: print sacreBLEU.")


def main(argv):
  FLAGS = flags.FLAGS
  sentences = argv[1:]
  try:
    if FLAGS.workdir is None:
      raise InferenceError("--workdir is required")
    if bool(sentences) == bool(FLAGS.input):
      raise InferenceError("give either sentences as arguments or --input FILE")
    if FLAGS.beam_size < 1:
      raise InferenceError(f"--beam_size must be at least 1, got {FLAGS.beam_size}")
    translator = Translator(FLAGS.workdir, FLAGS.step)
    options = DecodeOptions(beam_size=FLAGS.beam_size, alpha=FLAGS.alpha, max_len=FLAGS.max_len)
    if sentences:
      for line in translator.translate(sentences, options):
        print(line)
      return
    lines = _read_lines(FLAGS.input)
    references = _read_lines(FLAGS.reference) if FLAGS.reference else None
    if references is not None and len(references) != len(lines):
      raise InferenceError(f"--reference has {len(references)} lines, --input {len(lines)}")
    hypotheses = translate_lines(translator, lines, options, FLAGS.batch_size)
    if FLAGS.output:
      Path(FLAGS.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    else:
      print("\n".join(hypotheses))
    if references is not None:
      score, signature = corpus_bleu(hypotheses, references)
      print(f"BLEU = {score:.2f}  {signature}")
  except (InferenceError, checkpoint.CheckpointNotFoundError) as e:
    logging.get_absl_handler().flush()
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
