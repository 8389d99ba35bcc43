"""Trains the Transformer: python train.py --config configs/NAME.py[:ARG] --workdir DIR.

The same command as `python -m transformer_jax train`; re-running it with the same workdir
resumes from the latest checkpoint. The loop is transformer_jax/training/trainer.py.
"""

from transformer_jax.commands import train

if __name__ == "__main__":
  train.run()
