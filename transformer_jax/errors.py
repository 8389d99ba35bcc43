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

from absl import logging


class UserError(Exception):
  """A problem with what the user gave (flags, config, files), told in one line."""


def first_line(error: BaseException) -> str:
  """The first line of an exception's message, or its type's name where it has none."""
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


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
  logging.flush()


@contextlib.contextmanager
def reported(interrupted: str = "interrupted; nothing was written") -> Iterator[None]:
  """Runs a command's body: a UserError or an OSError (a disk that fills, a directory that
  goes away) exits 1 with one line; Ctrl-C exits 130 with `interrupted`."""
  try:
    yield
  except UserError as e:
    _flush()
    sys.exit(f"error: {e}")
  except OSError as e:
    _flush()
    sys.exit(f"error: {describe_os_error(e)}")
  except KeyboardInterrupt:
    _flush()
    print(f"error: {interrupted}", file=sys.stderr)
    if _busy_threads():
      # A library's worker thread (tfds's downloads) would hold the exit until its work ends.
      sys.stderr.flush()
      sys.stdout.flush()
      os._exit(130)
    sys.exit(130)


def _busy_threads() -> list[threading.Thread]:
  """The threads besides this one that Python waits for at exit."""
  return [t for t in threading.enumerate()
          if t is not threading.current_thread() and not t.daemon and t.is_alive()]


_interrupted: list[int] = []


def note_interrupts() -> None:
  """Ctrl-C (SIGINT) raises KeyboardInterrupt as usual and is also remembered, so that
  `raise_if_interrupted` catches one that library code swallowed (a conversion or a compile
  that catches every exception) before a command commits its output."""
  def handler(signum, frame):
    _interrupted.append(signum)
    raise KeyboardInterrupt
  signal.signal(signal.SIGINT, handler)


def raise_if_interrupted() -> None:
  if _interrupted:
    raise KeyboardInterrupt
