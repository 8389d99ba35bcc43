"""Translates with a trained workdir's latest (or given) checkpoint.

  python -m transformer_jax translate --workdir runs/fra_eng "I lost." "I'm home."
  python -m transformer_jax translate --workdir runs/fra_eng --beam_size 4 \
      --input test.eng --output test.hyp --reference test.fra
  python -m transformer_jax translate --workdir runs/fra_eng --split validation
  python -m transformer_jax translate --workdir runs/fra_eng --n_best 4 --input test.eng
  python -m transformer_jax translate --workdir runs/a --workdir runs/b --input test.eng

`--split` translates a split of the workdir's own dataset (its config.json's dataset, data_dir
and tfds_dir) and scores it against the split's targets: the validation BLEU recipes are
chosen by.

A source of more than `--segment_over` tokens (16) is translated sentence by sentence and the
translations joined: the model learned from single sentences (and up to concat_max joined ones)
and truncates a source over its max_len. `--long_beam_size B` decodes a source (or sentence)
of more than `--long_over` tokens (16) with beam B.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

from absl import app, flags, logging  # noqa: E402

import jax  # noqa: E402

from transformer_jax import errors, fs  # noqa: E402
from transformer_jax.commands import launch
from transformer_jax.decoding import platforms  # noqa: E402
from transformer_jax.decoding.inputs import check_output_path, read_lines  # noqa: E402
from transformer_jax.decoding.search import BEAM_STOPS  # noqa: E402
from transformer_jax.decoding.options import DecodeOptions, InferenceError  # noqa: E402
from transformer_jax.metrics import corpus_bleu  # noqa: E402
from transformer_jax.programs import ProgramStore  # noqa: E402
from transformer_jax.decoding.inputs import split_pairs  # noqa: E402
from transformer_jax.decoding.lines import n_best_lines, translate_lines  # noqa: E402
from transformer_jax.decoding.shortlist import for_workdir as shortlist_file  # noqa: E402
from transformer_jax.decoding.translator import Translator  # noqa: E402
from transformer_jax.runs.workdir import Workdir  # noqa: E402


def format_n_best(lists: list[list[tuple[float, str]]]) -> str:
  """n-best lists as text: one line per hypothesis, SOURCE_LINE<TAB>RANK<TAB>SCORE<TAB>
  TRANSLATION, source lines from 1, ranks from 1 (best first), the score with 6 decimals."""
  return "".join(f"{line}\t{rank}\t{score:.6f}\t{text}\n"
                 for line, entries in enumerate(lists, 1)
                 for rank, (score, text) in enumerate(entries, 1))


def define_flags():
  """Command-line flags; defined only when run as a command, so importing is side-effect free."""
  flags.DEFINE_multi_string("workdir", None, "Training workdir (config.json, tokenizer, "
                            "checkpoints/). Given more than once: an ensemble of workdirs that "
                            "share a tokenizer, their log-probabilities averaged at every step; "
                            "the first one's config gives the decoding defaults.")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
  flags.DEFINE_integer("beam_size", None, "Beam size; 1 decodes greedily. Default: the workdir's "
                       "config (decode.beam_size).")
  flags.DEFINE_float("alpha", None, "GNMT length penalty exponent (beam search). Default: the "
                     "workdir's config (decode.alpha).")
  flags.DEFINE_integer("max_len", 0, "Output tokens at most; 0: source length + 10.")
  flags.DEFINE_integer("segment_over", None, "Translate a source of more than this many tokens "
                       "sentence by sentence (pysbd's sentence ends) and join the translations "
                       "with a space; 0: every source; -1: none (a source over the model's "
                       "max_len is then truncated). Default: the workdir's config "
                       "(decode.segment_over, 16: chosen on validation documents, "
                       "docs/translating.md).")
  flags.DEFINE_integer("long_beam_size", None, "Beam size for a source (or a sentence of a split "
                       "source) of more than --long_over tokens; 0: --beam_size for all. Needs "
                       "beam search (--beam_size 2 or more). Default: the workdir's config.")
  flags.DEFINE_integer("long_over", None, "See --long_beam_size. Default: the workdir's config.")
  flags.DEFINE_enum("beam_stop", None, list(BEAM_STOPS), "When a beam search ends: first_k once "
                    "K hypotheses have ended (as CTranslate2), exact once no live beam can beat "
                    "the finished ones (more steps). Default: the workdir's config.")
  flags.DEFINE_integer("batch_size", 64, "With --slots 0: sentences per batch with --input or "
                       "--split (at most, with --batch_tokens).")
  flags.DEFINE_integer("batch_tokens", 1024, "With --slots 0: sentences per batch by a budget of "
                       "decoder rows x "
                       "source tokens (a beam's rows count; beam search gets twice the budget), "
                       "up to --batch_size; 0: --batch_size sentences in every batch.")
  flags.DEFINE_string("input", None, "File with one source sentence a line; - reads standard "
                      "input.")
  flags.DEFINE_string("output", None, "Where to write the translations of --input.")
  flags.DEFINE_string("reference", None, "Reference translations of --input: print sacreBLEU.")
  flags.DEFINE_string("split", None, "Translate this split of the workdir's dataset (e.g. "
                      "validation) and print sacreBLEU against its targets.")
  flags.DEFINE_string("split_from", None, "The workdir whose dataset --split is read from "
                      "(default: the first --workdir): a fine-tuned model scored on the data of "
                      "the run it started from, say.")
  flags.DEFINE_integer("n_best", 0, "Write the N best beams of every source with their scores "
                       "(SOURCE_LINE<TAB>RANK<TAB>SCORE<TAB>TRANSLATION, docs/translating.md) "
                       "instead of the best translation; needs --beam_size >= N. Sources are "
                       "translated whole (no sentence splitting).")
  flags.DEFINE_string("slots", "auto", "Decoding slots: sentences enter free slots as others "
                      "end (continuous batching; a beam of B is one slot of B rows). 'auto': "
                      "as many as suit this device and beam size; 0: fixed batches "
                      "(--batch_size, --batch_tokens) instead.")
  flags.DEFINE_string("lanes", "auto", "With slots: streams of slots that decode the input at "
                      "once, each in a thread of its own. 'auto': as many as suit this device "
                      "(2 on a CPU, 1 on a GPU or TPU); or a count.")
  flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache (a "
                      "later command loads the decoder instead of compiling it); default: the "
                      "training run's (run.compilation_cache_dir, or WORKDIR/jax_cache).")
  flags.DEFINE_bool("ema", True, "Decode with the evaluation parameters where the run kept them "
                    "(a moving average, ema_decay > 0, or schedule-free AdamW's); --noema: with "
                    "the parameters themselves.")
  flags.DEFINE_bool("int8", False, "Decode with int8 weights: every matrix product of the "
                    "layers and the tied output projection in int8, scaled per output channel "
                    "(CTranslate2's int8 scheme). Faster where the CPU multiplies int8 "
                    "quickly (VNNI); docs/translating.md gives the speed and BLEU measured.")
  flags.DEFINE_bool("shortlist", False, "Project each decoder step onto a vocabulary shortlist: "
                    "the union of the candidates of the sources decoded at once "
                    "(WORKDIR/shortlist.tsv, CTranslate2's vocabulary-map format; built from "
                    "the run's training pairs on first use). Needs decoding slots.")


def main(argv):
  FLAGS = flags.FLAGS
  sentences = argv[1:]
  with errors.reported():
    if not FLAGS.workdir:
      raise InferenceError("--workdir is required")
    if sum(map(bool, (sentences, FLAGS.input, FLAGS.split))) != 1:
      raise InferenceError("give either sentences as arguments, --input FILE or --split NAME")
    if FLAGS.split_from and not FLAGS.split:
      raise InferenceError("--split_from names where --split is read from: give --split too")
    if FLAGS.split and FLAGS.reference:
      raise InferenceError("--split scores against the split's own targets: drop --reference")
    if FLAGS.beam_size is not None and FLAGS.beam_size < 1:
      raise InferenceError(f"--beam_size must be at least 1, got {FLAGS.beam_size}")
    if FLAGS.batch_size < 1:
      raise InferenceError(f"--batch_size must be at least 1, got {FLAGS.batch_size}")
    if FLAGS.batch_tokens < 0:
      raise InferenceError(f"--batch_tokens must be 0 (off) or positive, got "
                           f"{FLAGS.batch_tokens}")
    if FLAGS.segment_over is not None and FLAGS.segment_over < -1:
      raise InferenceError(f"--segment_over must be -1 (split none), 0 (all) or positive, got "
                           f"{FLAGS.segment_over}")
    if (FLAGS.long_beam_size or 0) < 0 or (FLAGS.long_over or 0) < 0:
      raise InferenceError(f"--long_beam_size and --long_over must be 0 or positive, got "
                           f"{FLAGS.long_beam_size} and {FLAGS.long_over}")
    if FLAGS.alpha is not None and FLAGS.alpha < 0:
      raise InferenceError(f"--alpha must be >= 0 (0: no length penalty), got {FLAGS.alpha}")
    for flag, given in (("--input", FLAGS.input), ("--reference", FLAGS.reference)):
      if given and FLAGS.output and Path(FLAGS.output).resolve() == Path(given).resolve():
        raise InferenceError(f"--output {FLAGS.output} is the {flag} file: it would be "
                             "overwritten by the translations")
    if FLAGS.max_len < 0:
      raise InferenceError(f"--max_len must be 0 (source length + 10) or positive, got "
                           f"{FLAGS.max_len}")
    if FLAGS.output:
      check_output_path(FLAGS.output)
    if FLAGS.slots != "auto" and not (FLAGS.slots.isdigit()):
      raise InferenceError(f"--slots must be 'auto', 0 (fixed batches) or a count, got "
                           f"{FLAGS.slots!r}")
    if FLAGS.lanes != "auto" and not (FLAGS.lanes.isdigit() and int(FLAGS.lanes) > 0):
      raise InferenceError(f"--lanes must be 'auto' or a positive count, got {FLAGS.lanes!r}")
    if FLAGS.n_best < 0:
      raise InferenceError(f"--n_best must be 0 (off) or positive, got {FLAGS.n_best}")
    if FLAGS.n_best and FLAGS.long_beam_size:
      raise InferenceError("--n_best decodes every source with --beam_size: drop "
                           "--long_beam_size")
    if FLAGS.split:
      lines, references = split_pairs(FLAGS.split_from or FLAGS.workdir[0], FLAGS.split)
    else:
      lines = read_lines(FLAGS.input) if FLAGS.input else sentences
      references = read_lines(FLAGS.reference) if FLAGS.reference else None
    if references is not None and len(references) != len(lines):
      raise InferenceError(f"--reference has {len(references)} lines, --input {len(lines)}")
    if references is not None and not any(line.strip() for line in lines):
      raise InferenceError(f"--input {FLAGS.input} holds no sentence: nothing to translate or "
                           "score")
    for workdir in FLAGS.workdir:
      Workdir(workdir).check_family("encoder_decoder", "translate")
    # A line with characters but no token (say, only U+200B) is refused before the model loads.
    tokenizer = Workdir(FLAGS.workdir[0]).tokenizers().src
    for number, (line, ids) in enumerate(zip(lines, tokenizer.encode(lines)), 1):
      if line.strip() and not ids:
        raise InferenceError(f"sentence {number} is empty (it holds no character the tokenizer "
                             f"keeps: {line[:20]!r})")
    # The recipe's decoding settings (the workdir's config), unless a flag overrides one.
    defaults = dataclasses.asdict(Workdir(FLAGS.workdir[0]).load_config().decode)
    for name in defaults:
      if getattr(FLAGS, name) is None:
        setattr(FLAGS, name, defaults[name])
    if FLAGS.long_beam_size and FLAGS.beam_size == 1:
      raise InferenceError("--long_beam_size needs beam search: --beam_size 1 decodes greedily")
    if FLAGS.n_best > FLAGS.beam_size:
      raise InferenceError(f"--n_best {FLAGS.n_best} is more than the beam size "
                           f"({FLAGS.beam_size}): raise --beam_size")
    if FLAGS.n_best:
      FLAGS.long_beam_size = 0  # The workdir's default: n-best decodes every source alike.
    launch.keep_freed_memory()
    cache = launch.use_compilation_cache(FLAGS.workdir[0], FLAGS.compilation_cache_dir)
    programs = ProgramStore(cache and cache / "programs")
    # What decides the programs a command runs: those the last such command ran load while
    # the checkpoint is restored.
    settings = repr(("translate", FLAGS.workdir, FLAGS.beam_size, FLAGS.max_len,
                     FLAGS.beam_stop, FLAGS.segment_over, FLAGS.long_over,
                     FLAGS.long_beam_size, FLAGS.n_best, FLAGS.slots, FLAGS.lanes,
                     bool(FLAGS.input or FLAGS.split), FLAGS.int8, FLAGS.shortlist))
    programs.preload(settings)
    if FLAGS.shortlist and FLAGS.slots == "0":
      raise InferenceError("--shortlist needs decoding slots: --slots 0 decodes in batches")
    translator = Translator(FLAGS.workdir, FLAGS.step, ema=FLAGS.ema, programs=programs,
                            int8_weights=FLAGS.int8,
                            shortlist=shortlist_file(FLAGS.workdir[0]) if FLAGS.shortlist else None)
    if FLAGS.lanes != "auto":
      translator.lanes = int(FLAGS.lanes)
    limit = translator.max_output_len
    if FLAGS.max_len > limit:
      raise InferenceError(f"--max_len {FLAGS.max_len} is over {limit}, 4 x the max_len the "
                           "model was trained with")
    options = DecodeOptions(beam_size=FLAGS.beam_size, alpha=FLAGS.alpha, max_len=FLAGS.max_len,
                            beam_stop=FLAGS.beam_stop)
    many = bool(FLAGS.input or FLAGS.split)
    batch_size = FLAGS.batch_size if many else max(1, len(lines))
    segment_over = None if FLAGS.segment_over < 0 else FLAGS.segment_over
    long_beam = (FLAGS.long_over, FLAGS.long_beam_size) if FLAGS.long_beam_size else None
    num_slots = (platforms.settings(jax.default_backend()).slots(FLAGS.beam_size)
                 if FLAGS.slots == "auto" else int(FLAGS.slots))
    if FLAGS.n_best:
      lists = n_best_lines(translator, lines, FLAGS.n_best, options, batch_size, progress=many,
                           batch_tokens=FLAGS.batch_tokens, num_slots=num_slots)
      text = format_n_best(lists)
      hypotheses = [entries[0][1] if entries else "" for entries in lists]
    else:
      hypotheses = translate_lines(translator, lines, options, batch_size, progress=many,
                                   segment_over=segment_over, long_beam=long_beam,
                                   batch_tokens=FLAGS.batch_tokens, num_slots=num_slots)
      text = "".join(h + "\n" for h in hypotheses)
    programs.remember(settings)
    if FLAGS.output:
      fs.replace_file(FLAGS.output, text.encode("utf-8"))
    else:
      print(text, end="")
    if references is not None:
      score, signature = corpus_bleu(hypotheses, references)
      print(f"BLEU = {score:.2f}  {signature}")
    if programs.compiled:
      # A first command: its output is written; a later one, its lanes timed differently, may
      # shrink its runs to sizes this one never ran, each a compilation of seconds then.
      logging.info("compiling the slots' other run sizes for later commands (%d programs "
                   "compiled so far)", programs.compiled)
      try:
        translator.compile_slot_programs()
      except KeyboardInterrupt:  # Only the programs for later commands are left out.
        print("error: interrupted while compiling programs for later commands; the "
              "translations were written", file=sys.stderr)
        sys.exit(130)


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
