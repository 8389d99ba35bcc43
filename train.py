"""Trains the Transformer: python train.py --config configs/NAME.py[:ARG] --workdir DIR.

The same command as `python -m transformer_jax train`; re-running it with the same workdir
resumes from the latest checkpoint. The loop is transformer_jax/training/trainer.py.
"""

from transformer_jax import starting

if __name__ == "__main__":
  starting.exit_130_on_ctrl_c()  # Before any other import.

from transformer_jax import errors  # noqa: E402

if __name__ == "__main__":
  errors.note_interrupts(starting=True)  # Ctrl-C from here on: exit 130, one line.

  def run():
    from transformer_jax.commands import train
    train.run()

  errors.run_command(run)
