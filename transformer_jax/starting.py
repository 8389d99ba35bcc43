"""Ctrl-C in a command's first moments, before `errors.note_interrupts` is set: the entry
points (`python -m transformer_jax`, train.py) call `exit_130_on_ctrl_c` before they import
anything else, so that a SIGINT while `logging`, `re` or absl load is one line and exit 130, not
a KeyboardInterrupt traceback from inside their import (seen at 0.1 s under load). Only `os`
and `signal` here: nothing that takes time to load."""

import os
import signal

NOTHING_WRITTEN = "interrupted; nothing was written"  # The line of every early Ctrl-C.


def _exit_130(signum, frame):
  os.write(2, f"error: {NOTHING_WRITTEN}\n".encode())
  os._exit(130)


def exit_130_on_ctrl_c() -> None:
  """Until errors.note_interrupts replaces it; a SIGINT ignored (nohup, a background job) is
  left ignored."""
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_130)
