"""Continues text prompts with a trained language model's latest (or given) checkpoint.

  python -m transformer_jax generate --workdir runs/lm_shakespeare "ROMEO." "To be, or not"
  python -m transformer_jax generate --workdir runs/lm_shakespeare --input prompts.txt \
      --temperature 0.8 --top_k 50 --seed 1 --output samples.jsonl

Greedy by default; `--temperature`, `--top_k` or `--top_p` sample, with `--seed`. A prompt
continues alike in any batch. Each prompt's text and continuation are printed (or written, with
`--output`, one JSON object a line: {"prompt", "completion"}). In a prompt, "\\n" stands for a
newline.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402

from transformer_jax import errors, fs  # noqa: E402
from transformer_jax.commands import launch
from transformer_jax.decoding import search
from transformer_jax.decoding.inputs import check_output_path, read_lines  # noqa: E402
from transformer_jax.decoding.options import InferenceError  # noqa: E402
from transformer_jax.runs.workdir import Workdir  # noqa: E402


def define_flags():
  flags.DEFINE_string("workdir", None, "A language model's training workdir.")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the newest that verifies.")
  flags.DEFINE_string("input", None, "File with one prompt a line; - reads standard input.")
  flags.DEFINE_string("output", None, "Where to write the continuations (JSON lines).")
  flags.DEFINE_integer("max_new_tokens", 100, "Tokens to generate at most a prompt (fewer where "
                       "the model's max_len comes first, or at <eos>).")
  flags.DEFINE_float("temperature", None, "Sample at this temperature (default: greedy, or 1.0 "
                     "with --top_k / --top_p).")
  flags.DEFINE_integer("top_k", 0, "Sample from the K most likely tokens (0: all).")
  flags.DEFINE_float("top_p", 1.0, "Sample from the most likely tokens holding this much "
                     "probability (1.0: all).")
  flags.DEFINE_integer("seed", 0, "The sampling seed.")
  flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache; "
                      "default: the training run's (WORKDIR/jax_cache).")


def sampler_of(temperature: float | None, top_k: int, top_p: float):
  """search.Greedy, or search.Sampling where any sampling flag is given; checked."""
  if temperature is None and not top_k and top_p == 1.0:
    return search.Greedy()
  if temperature is not None and not 0 < temperature < float("inf"):  # NaN: never sampled.
    raise InferenceError(f"--temperature must be a positive number, got {temperature}")
  if top_k < 0:
    raise InferenceError(f"--top_k must be 0 (all) or positive, got {top_k}")
  if not 0 < top_p <= 1:
    raise InferenceError(f"--top_p must be in (0, 1], got {top_p}")
  return search.Sampling(temperature=1.0 if temperature is None else temperature, top_k=top_k,
                         top_p=top_p)


def main(argv):
  FLAGS = flags.FLAGS
  prompts = [p.replace("\\n", "\n") for p in argv[1:]]
  with errors.reported():
    if not FLAGS.workdir:
      raise InferenceError("--workdir is required")
    if bool(prompts) == bool(FLAGS.input):
      raise InferenceError("give either prompts as arguments or --input FILE")
    if FLAGS.max_new_tokens < 1:
      raise InferenceError(f"--max_new_tokens must be at least 1, got {FLAGS.max_new_tokens}")
    if not 0 <= FLAGS.seed < 2 ** 32:  # The completions server's range: the same draws.
      raise InferenceError(f"--seed must be an integer from 0 to 2**32 - 1, got {FLAGS.seed}")
    sampler = sampler_of(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    if FLAGS.input:
      prompts = [p.replace("\\n", "\n") for p in read_lines(FLAGS.input)]
      if not prompts:
        raise InferenceError(f"--input {FLAGS.input} holds no prompt")
    if FLAGS.output:
      check_output_path(FLAGS.output)
      if FLAGS.input and Path(FLAGS.output).resolve() == Path(FLAGS.input).resolve():
        raise InferenceError(f"--output {FLAGS.output} is the --input file: it would be "
                             "overwritten")
    Workdir(FLAGS.workdir).check_family("decoder_only", "generate")
    from transformer_jax.decoding.completer import Completer  # The model loads after the checks.
    launch.use_compilation_cache(FLAGS.workdir, FLAGS.compilation_cache_dir)
    completer = Completer(FLAGS.workdir, FLAGS.step)
    texts = completer.complete(prompts, FLAGS.max_new_tokens, sampler, FLAGS.seed)
    if FLAGS.output:
      fs.replace_file(FLAGS.output, "".join(
          json.dumps({"prompt": p, "completion": t}, ensure_ascii=False) + "\n"
          for p, t in zip(prompts, texts)).encode("utf-8"))
    else:
      for p, t in zip(prompts, texts):
        print(f"{p}{t}\n{'-' * 40}")


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
