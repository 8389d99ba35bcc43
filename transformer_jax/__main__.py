"""The front door: python -m transformer_jax COMMAND [FLAGS].

  train       train a config in a workdir, resuming from its latest checkpoint (as train.py)
  translate   translate sentences, a file or a split with a trained workdir; sacreBLEU
  generate    continue text prompts with a trained language model (greedy or sampled)
  fill        the likeliest tokens for each [MASK] of a text, with a masked language model
  classify    label texts with a fine-tuned classifier; with --labels, its accuracy
  average     a new workdir with the mean parameters of a workdir's last checkpoints
  visualize   attention heatmaps of one translation
  aot         compile the training programs for a TPU topology or GPU target without one
  export      a workdir's model for CTranslate2, jax.export or Hugging Face transformers
  serve       an HTTP server of translations, or of a language model's completions
              (OpenAI's API), decoding concurrent requests together
  download    the corpora and held-out test sets from their public sources
  report      where a run's wall time went (its goodput ledger) and its curves as a PNG
"""

from __future__ import annotations

from transformer_jax import starting

if __name__ == "__main__":  # Before the imports below (logging's take a while under load).
  starting.exit_130_on_ctrl_c()

import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from transformer_jax import errors  # noqa: E402

COMMANDS = ("train", "translate", "generate", "fill", "classify", "average", "visualize", "aot",
            "export", "serve", "download", "report")

# Commands that have written all they make (their output files closed, their checkpoints only
# read) when they end, and which then leave at once: tearing jax's runtime down, its compiled
# programs freed one by one, took a translate command 0.4 s (docs/translating.md).
END_AT_ONCE = ("translate",)


def main() -> None:
  errors.note_interrupts(starting=True)  # Ctrl-C from here on: exit 130, one line.
  if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
    print(__doc__.strip())
    sys.exit(0 if len(sys.argv) >= 2 else 2)
  name = sys.argv[1]
  if name not in COMMANDS:
    sys.exit(f"error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
  sys.argv = [f"python -m transformer_jax {name}", *sys.argv[2:]]
  try:
    errors.run_command(lambda: importlib.import_module(f"transformer_jax.commands.{name}").run())
  except SystemExit as done:  # absl's app.run ends every command with one.
    if name in END_AT_ONCE and not done.code:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(0)
    raise


if __name__ == "__main__":
  main()
