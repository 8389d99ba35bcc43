"""Stopping on SIGTERM or SIGINT at a step boundary that every host agrees on.

One process: a Python handler notes the signal; the loop finishes its step, saves, and exits 0.
Several processes (jax.distributed): SIGTERM goes to jax's preemption service, which agrees on
one step for every host (the next step after the furthest host's, `reached_preemption_sync_
point`), so all of them save the same step; a SIGINT is passed on to it as a SIGTERM. A second
signal to a process that is already stopping ends it at once.
"""

from __future__ import annotations

import os
import signal

from absl import logging
from jax.experimental import multihost_utils


class Preemption:

  def __init__(self, multi_process: bool):
    self.multi_process = multi_process
    self.signal_name: str | None = None
    self._previous = {}
    signals = [signal.SIGINT] + ([] if multi_process else [signal.SIGTERM])
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    name = signal.Signals(signum).name
    if self.signal_name is not None:
      logging.error("Second signal (%s): exiting now, without a checkpoint", name)
      logging.flush()
      os._exit(128 + signum)
    self.signal_name = name
    logging.warning("%s received: stopping after this step, with a checkpoint", name)
    if self.multi_process:  # Into jax's preemption service, which all hosts consult.
      os.kill(os.getpid(), signal.SIGTERM)

  def should_stop(self, step: int) -> bool:
    """Called once per step by every host, after the step: whether to save and stop now."""
    if self.multi_process:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signal_name is not None

  def restore(self) -> None:
    """Puts back the handlers that were installed before."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
