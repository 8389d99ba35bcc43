"""Who may drive a server, checked before either app reads a request: an API key where one is
set, the Host header of a server that listens on loopback only, and the body's content type.

A web page in the user's browser can send a POST to http://127.0.0.1:PORT without asking (a
"simple" cross-origin request: text/plain or a form's content type), and a page whose name
resolves to 127.0.0.1 (DNS rebinding) can even read the answers. Refusing every POST whose
content type is not JSON makes the browser ask first (a preflight this server never allows),
and refusing a Host that is not a loopback name defeats the rebinding. OpenAI's clients send
`Authorization: Bearer KEY` and `Content-Type: application/json`, which pass.

Written by hand as a plain ASGI wrapper (a few lines) rather than Starlette's
TrustedHostMiddleware plus a key middleware: the three checks share one refusal, in each
server's own error shape.
"""

from __future__ import annotations

import hmac
import json
from typing import Callable

# Paths a probe reads without a key (a load balancer's or an orchestrator's health checks).
OPEN_PATHS = ("/health", "/ready")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback_hosts(host: str) -> tuple[str, ...] | None:
  """The Host names a server listening on `host` answers: the loopback names where it listens
  on loopback only, None (any) where it listens on other interfaces."""
  return LOOPBACK if host in LOOPBACK else None


def _host_name(value: str) -> str:
  """The name of a Host header's value: "127.0.0.1:8080" -> "127.0.0.1", "[::1]:80" -> "::1"."""
  if value.startswith("["):
    return value[1:].split("]", 1)[0]
  return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
  """ASGI middleware: refuses, in `refusal`'s shape (status, message, code) -> JSON object, a
  request that names a Host outside `hosts` (None: any), lacks the `api_key` (None: none
  needed) outside OPEN_PATHS, or POSTs a body not declared JSON (a body without a content
  type is one a page's fetch() may send unasked too)."""

  def __init__(self, app, api_key: str | None, hosts: tuple[str, ...] | None,
               refusal: Callable[[int, str, str], dict]):
    self.app, self.api_key, self.hosts, self.refusal = app, api_key, hosts, refusal

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      problem = self._problem(scope)
      if problem:
        status, message, code = problem
        body = json.dumps(self.refusal(status, message, code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if status == 401:
          headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await self.app(scope, receive, send)

  def _problem(self, scope) -> tuple[int, str, str] | None:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    # Host names are case-insensitive; HTTP/1.0 has no Host header (a browser, whose
    # requests a rebinding forges, always sends one).
    if self.hosts is not None and not (scope.get("http_version") == "1.0"
                                       and "host" not in headers):
      host = _host_name(headers.get("host", "")).lower()
      if host not in self.hosts:
        return (421, f"this server answers requests to {', '.join(self.hosts)} only, not to "
                f"{host or 'no Host'} (--host 0.0.0.0 listens on every interface)",
                "misdirected_request")
    if self.api_key is not None and scope["path"] not in OPEN_PATHS:
      scheme, _, key = headers.get("authorization", "").partition(" ")
      if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                               self.api_key.encode()):
        return (401, "a valid API key is needed: send the header 'Authorization: Bearer "
                "KEY' (the server's --api_key)", "invalid_api_key")
    if scope["method"] == "POST":
      kind = headers.get("content-type", "").split(";")[0].strip()
      if kind.lower() != "application/json":
        return (415, "the request body must be JSON, sent with the header Content-Type: "
                f"application/json ({f'not {kind!r}' if kind else 'none was sent'})",
                "unsupported_media_type")
    return None
