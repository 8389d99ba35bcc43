"""The errors a user can fix, and how every command reports them: one line, an exit status.

Every module raises its own subclass of UserError (a bad config field, a missing dataset, a
damaged checkpoint, ...), worded to name the problem and what to do; a command's body runs
inside `reported()`, which turns one into `error: MESSAGE` on stderr and exit status 1. Any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from transformer_jax.starting import NOTHING_WRITTEN


class UserError(Exception):
  """A problem with what the user gave (flags, config, files), told in one line."""


def first_line(error: BaseException) -> str:
  """The first line of an exception's message (less tensorstore's dump of its spec), or its
  type's name where it has none."""
  text = str(error).strip()
  return text.splitlines()[0].split(" See full TensorStore details")[0] if text else (
      type(error).__name__)


def describe_os_error(error: OSError) -> str:
  """One line for a file-system error: what failed, on which path."""
  if isinstance(error, UserError) or not error.strerror:
    return str(error)
  paths = " -> ".join(str(p) for p in (error.filename, error.filename2) if p)
  return f"{error.strerror}: {paths}" if paths else error.strerror


def _flush() -> None:
  # Reads of damaged checkpoints that failed (and were reported) leave futures whose errors
  # asyncio would print again at exit, after the error line.
  std_logging.getLogger("asyncio").setLevel(std_logging.CRITICAL)
  absl_logging = sys.modules.get("absl.logging")  # Not imported here: this module loads first,
  if absl_logging is not None:  # before Ctrl-C is handled, so it loads nothing slow.
    absl_logging.flush()


@contextlib.contextmanager
def reported(interrupted: str = NOTHING_WRITTEN) -> Iterator[None]:
  """Runs a command's body: a UserError or an OSError (a disk that fills, a directory that
  goes away) exits 1 with one line; Ctrl-C exits 130 with `interrupted`, also one that came
  while the command started and that a library swallowed (note_interrupts)."""
  _starting.clear()  # The body may write: from here on Ctrl-C raises, for it to clean up.
  try:
    raise_if_interrupted()
    yield
  except UserError as e:
    _flush()
    sys.exit(f"error: {e}")
  except OSError as e:
    _flush()
    sys.exit(f"error: {describe_os_error(e)}")
  except KeyboardInterrupt:
    exit_interrupted(interrupted)
  except Exception:
    if _interrupted:  # The interrupt, turned into another error (a C extension's import).
      exit_interrupted(interrupted)
    raise


def exit_interrupted(message: str) -> None:
  """`error: MESSAGE` and exit status 130, at once (exit_at_once)."""
  exit_at_once(message, 130)


# The real stderr's descriptor while file descriptor 2 is captured for a while (aot's plugin
# loading): a command that exits at once writes its line there, not into the capture.
stderr_elsewhere: list[int] = []


def exit_at_once(message: str, status: int) -> None:
  """`error: MESSAGE` and exit `status`, at once. Not through the interpreter's teardown: with
  a library's threads still in their native work (tfds preparing a dataset, orbax reading a
  checkpoint, XLA compiling) it crashed after the line (a segfault, exit 139), or waited for
  them (jax's shutdown barrier, for a process that is gone)."""
  _flush()
  if stderr_elsewhere:
    sys.stderr.flush()
    os.dup2(stderr_elsewhere[-1], 2)
  print(f"error: {message}", file=sys.stderr)
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(status)


def run_command(run) -> None:
  """Runs a command (`run()`: its flags parsed, its body inside `reported`) with the interrupt
  handler installed first, so that Ctrl-C at any moment exits 130 in one line: while the
  libraries load and the flags parse too."""
  note_interrupts(starting=True)
  try:
    run()
  except KeyboardInterrupt:  # Before the command's body began.
    exit_interrupted(NOTHING_WRITTEN)
  except Exception:
    if _interrupted:  # Raised in a C extension's initialization: "ImportError: initialization
      exit_interrupted(NOTHING_WRITTEN)  # failed" (tensorstore's).
    raise
  finally:  # Done: a Ctrl-C now would only cut the interpreter's teardown short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_interrupted: list[int] = []
_starting: list[bool] = []  # Set while a command starts (its flags parse): nothing written yet.


def note_interrupts(starting: bool = False) -> None:
  """Ctrl-C (SIGINT) raises KeyboardInterrupt as usual and is also remembered, so that
  `raise_if_interrupted` catches one that library code swallowed (a conversion or a compile
  that catches every exception) before a command goes on or commits its output.

  `starting`: until a command's body begins (`reported`), Ctrl-C exits 130 in one line at
  once instead. The libraries load then, and a KeyboardInterrupt raised inside a module's
  import was printed as a traceback before the line, or aborted the interpreter (an enum made
  during a C extension's initialization: exit -6)."""
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    return  # Started with Ctrl-C ignored (nohup, a background job): left so.
  if starting:
    _starting[:] = [True]

  def handler(signum, frame):
    _interrupted.append(signum)
    if _starting:
      exit_interrupted(NOTHING_WRITTEN)
    raise KeyboardInterrupt

  def unraisable(report):  # Raised where Python can only print it (jax's gc callback, a
    if report.exc_type is not KeyboardInterrupt:  # __del__): noted above, acted on later.
      default_unraisable(report)

  default_unraisable = sys.unraisablehook
  signal.signal(signal.SIGINT, handler)
  sys.unraisablehook = unraisable


def raise_if_interrupted() -> None:
  if _interrupted:
    raise KeyboardInterrupt
