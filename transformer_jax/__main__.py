"""The front door: python -m transformer_jax COMMAND [FLAGS].

  train       train a config in a workdir, resuming from its latest checkpoint (as train.py)
  translate   translate sentences, a file or a split with a trained workdir; sacreBLEU
  generate    continue text prompts with a trained language model (greedy or sampled)
  average     a new workdir with the mean parameters of a workdir's last checkpoints
  visualize   attention heatmaps of one translation
  aot         compile the training programs for a TPU topology or GPU target without one
  export      a workdir's model as a CTranslate2 model or serialized jax decoders
  serve       an HTTP translation server that batches concurrent requests
  download    the corpora and held-out test sets from their public sources
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = ("train", "translate", "generate", "average", "visualize", "aot", "export", "serve", "download")


def main() -> None:
  if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
    print(__doc__.strip())
    sys.exit(0 if len(sys.argv) >= 2 else 2)
  name = sys.argv[1]
  if name not in COMMANDS:
    sys.exit(f"error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}")
  sys.argv = [f"python -m transformer_jax {name}", *sys.argv[2:]]
  importlib.import_module(f"transformer_jax.commands.{name}").run()


if __name__ == "__main__":
  main()
