"""GET /metrics on both servers, in Prometheus' text format, written by `prometheus_client` (the
format's reference library): requests by endpoint and status, their latency, the first event of
each streamed response, and the server's own counts (what GET /stats says, the queue, the busy
slots, the programs compiled), read when a scraper asks.

The counts are the process's since it started; a scraper's `rate()` turns them into rates.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "transformer_jax_"
# Seconds: a health check's milliseconds to a long request of beams on a CPU.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Figure(NamedTuple):
  """One of a server's own counts: `kind` counter (only grows) or gauge (goes up and down)."""
  kind: str
  help: str
  value: float


class _Figures:
  """A collector of the figures `read` returns ({name: Figure}), read at each scrape."""

  def __init__(self, read: Callable[[], dict[str, Figure]]):
    self.read = read

  def collect(self):
    for name, figure in self.read().items():
      family = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
      yield family(PREFIX + name, figure.help, value=figure.value)


class Metrics:
  """ASGI middleware over a server's app: times and counts each HTTP request by its endpoint
  (a path the app routes; `other` for the rest, so that a scan of random paths adds no
  series) and the status it was answered with, and answers GET /metrics itself. `guard`
  (app -> app) wraps what is inside the counting, /metrics included: the requests it refuses
  are counted too, and /metrics needs what the app's endpoints need."""

  def __init__(self, app, read: Callable[[], dict[str, Figure]], programs=None,
               guard: Callable | None = None):
    self.app = app
    self.inner = guard(self._route) if guard else self._route
    self.endpoints = {route.path for route in getattr(app, "routes", ())} | {"/metrics"}
    self.registry = CollectorRegistry(auto_describe=False)
    self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by endpoint and "
                            "status", ["endpoint", "status"], registry=self.registry)
    self.seconds = Histogram(PREFIX + "request_seconds", "Seconds from a request's arrival to "
                             "the end of its answer (a stream's last event)", ["endpoint"],
                             buckets=BUCKETS, registry=self.registry)
    self.first_event = Histogram(PREFIX + "first_event_seconds", "Streamed answers: seconds "
                                 "from the request's arrival to its first event (the first "
                                 "tokens)", ["endpoint"], buckets=BUCKETS,
                                 registry=self.registry)

    def figures() -> dict[str, Figure]:
      extra = {} if programs is None else {
          "programs_compiled": Figure("counter", "Programs compiled by this process",
                                      programs.compiled),
          "programs_loaded": Figure("counter", "Programs loaded from the compilation cache "
                                    "instead", programs.loaded)}
      return {**read(), **extra}

    self.registry.register(_Figures(figures))

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    path = scope["path"]
    endpoint = path if path in self.endpoints else "other"
    start = time.monotonic()
    state = {"status": 500, "stream": False, "first": True, "done": False}

    def finish() -> None:
      if not state["done"]:
        state["done"] = True
        self.requests.labels(endpoint, str(state["status"])).inc()
        self.seconds.labels(endpoint).observe(time.monotonic() - start)

    async def sending(message):
      if message["type"] == "http.response.start":
        state["status"] = message["status"]
        headers = dict(message.get("headers") or [])
        state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
      elif message["type"] == "http.response.body":
        if state["stream"] and state["first"] and message.get("body"):
          state["first"] = False
          self.first_event.labels(endpoint).observe(time.monotonic() - start)
        if not message.get("more_body", False):
          finish()
      await send(message)

    try:
      await self.inner(scope, receive, sending)
    finally:
      finish()  # A client gone before the end: counted with the status it was given.

  async def _route(self, scope, receive, send):
    if scope["path"] == "/metrics":
      await self._answer(scope, send)
    else:
      await self.app(scope, receive, send)

  async def _answer(self, scope, send) -> None:
    if scope["method"] not in ("GET", "HEAD"):
      body, status, kind = b"GET /metrics only\n", 405, b"text/plain; charset=utf-8"
    else:
      body, status, kind = generate_latest(self.registry), 200, CONTENT_TYPE_LATEST.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body",
                "body": b"" if scope["method"] == "HEAD" else body})
