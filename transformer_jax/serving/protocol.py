"""The HTTP protocol both servers speak: uvicorn's h11 protocol, which refuses a request head
(request line and headers) over 16 KB, with a time limit on receiving a head.

uvicorn's httptools protocol takes a head of any size (a few clients sending endless headers
grew the server by gigabytes), and neither of uvicorn's protocols limits how long a head may
take: clients that send a header line every few seconds could hold every connection the
server allows (--max_connections) and keep everyone else at 503. uvicorn has no setting for
that, so this subclass adds the one timer; the body has its own limit (bodies.read).
"""

from __future__ import annotations

import asyncio

from absl import logging
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_head_timeout(seconds: float) -> type[H11Protocol]:
  """uvicorn's h11 protocol, closing a connection whose request head takes over `seconds`."""
  return type("HeadTimedH11Protocol", (_HeadTimed,), {"head_timeout": seconds})


class _HeadTimed(H11Protocol):
  head_timeout = 30.0
  _timer: asyncio.TimerHandle | None = None

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self._watch()

  def data_received(self, data: bytes) -> None:
    super().data_received(data)
    self._watch()

  def connection_lost(self, exc) -> None:
    self._stop()
    super().connection_lost(exc)

  def _waiting_for_a_head(self) -> bool:
    return self.cycle is None or self.cycle.response_complete

  def _watch(self) -> None:
    """A timer runs while a head is awaited and data of it has come (or the connection is new);
    an idle kept-alive connection is uvicorn's keep-alive timer's."""
    if not self._waiting_for_a_head():
      self._stop()
    elif self._timer is None and not self.transport.is_closing():
      self._timer = self.loop.call_later(self.head_timeout, self._too_slow)

  def _stop(self) -> None:
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None

  def _too_slow(self) -> None:
    self._timer = None
    if self._waiting_for_a_head() and not self.transport.is_closing():
      logging.info("closed a connection from %s whose request head took over %g s",
                   self.client and self.client[0], self.head_timeout)
      self.transport.close()
