"""What both HTTP servers read of a request: its body, within a byte limit, as a JSON object.
Each server answers a BadBody in its own error shape (400)."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from transformer_jax import errors


class BadBody(Exception):
  """A request body over the limit, not UTF-8, not JSON, or not a JSON object."""


async def read(request: Request, limit: int, timeout: float) -> bytes:
  """The request body, refused as soon as it passes `limit` bytes or `timeout` seconds (a
  client that sends it slowly holds a connection and a worker's memory)."""
  declared = request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > limit:
    raise BadBody(f"the request body has {declared} bytes; the limit is {limit} "
                  "(--max_request_bytes)")
  chunks, size = [], 0
  try:
    async with asyncio.timeout(timeout):
      async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
          raise BadBody(f"the request body is over {limit} bytes (--max_request_bytes)")
        chunks.append(chunk)
  except TimeoutError:
    raise BadBody(f"the request body did not arrive within {timeout:g} s "
                  "(--read_timeout)") from None
  return b"".join(chunks)


class _LongNumber(Exception):
  pass


def _integer(text: str) -> int:
  """json's parse_int, short of Python's own limit (4,300 digits), whose message names a
  Python call the client cannot make."""
  if len(text.lstrip("-")) > 100:
    raise _LongNumber(f"a number in the request body has {len(text.lstrip('-')):,} digits; no "
                      "field takes more than 100")
  return int(text)


def json_object(body: bytes, example: str) -> dict:
  """The body as a JSON object; `example`: what one looks like, for the message."""
  try:
    text = body.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadBody(f"the request body is not UTF-8 text (byte {e.start + 1})") from None
  try:
    request = json.loads(text, parse_int=_integer)
  except _LongNumber as e:
    raise BadBody(str(e)) from None
  except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError.
    raise BadBody(f"the request body is not valid JSON: {errors.first_line(e)}") from None
  if not isinstance(request, dict):
    raise BadBody(f"the request must be a JSON object: {example}")
  return request
