"""A language model served through OpenAI's completions API (Starlette): the sequences of
concurrent requests decoded together in decoding slots (decoding/lm_slots.py), each joining
between two steps and leaving when it ends (continuous batching).

  POST /v1/completions  OpenAI's fields: model, prompt (a string or a list), max_tokens,
                        temperature, top_p, top_k, n, stop, seed, logprobs, echo, stream
                        (server-sent events ending "data: [DONE]"), stream_options
  GET  /v1/models       the one model served (its id: the workdir's name)
  GET  /health, /ready, /stats  as the translation server's

Every refusal is OpenAI's error shape, {"error": {"message", "type", "param", "code"}}: 400 for
a field it does not take or a value out of range (naming the field), 404 for another model, 503
while compiling or when the queue is full (with Retry-After). One log line per request.
This module is the app (routes, streams, answers); a request's fields are parsed and checked in
openai_requests.py, and the thread that schedules the sequences is lm_engine.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time

from absl import logging
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from transformer_jax.serving import bodies
from transformer_jax.serving.batcher import NotReady, QueueFull
from transformer_jax.serving.lm_engine import Sequence
from transformer_jax.serving.metrics import Figure
from transformer_jax.serving.openai_requests import Choice, Parsed, Refused, Service, refusal

async def _disconnected(request: Request) -> None:
  """Returns once the client of a request whose body was read has gone (ASGI's
  http.disconnect); a non-streaming answer is otherwise computed whole for nobody."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def create_app(service: Service) -> Starlette:
  """The ASGI application; its lifespan starts the engine (compiling in the background) and
  stops it at shutdown."""
  engine, limits = service.engine, service.limits

  def start(parsed: Parsed):
    """(choices, sequences, events): the request's sequences queued in the engine."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    choices = [Choice(service, parsed, i) for i in range(len(parsed.prompts) * parsed.n)]
    sequences = [Sequence(c.index, c.prompt, parsed.max_tokens,
                          dataclasses.replace(parsed.draw, item=c.index),
                          parsed.logprobs is not None, events, loop) for c in choices]
    engine.submit(sequences)
    return choices, sequences, events

  def head(parsed: Parsed, rid: str) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": service.name}

  def usage(parsed: Parsed, choices) -> dict:
    prompt = sum(len(ids) - 1 for ids in parsed.prompts)
    new = sum(c.new_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}

  async def next_event(events, choices, sequences):
    """The choice the engine's next news is of, and whether that news ends it; (None, False)
    for news of a choice already ended (a stop string met before its slot freed)."""
    index, positions, end = await events.get()
    if end == "error":
      raise Refused(f"the decoder stopped: {engine.error!r}", status=500, kind="server_error")
    if end == "shutdown":
      raise Refused("the server is shutting down; send the request again (to another "
                    "replica)", status=503, kind="server_error", code="shutting_down",
                    retry=True)
    choice = choices[index]
    if choice.finish is not None:
      return None, False
    choice.add(positions, end)
    if choice.finish == "stop" and end is None:  # A stop string: its slot frees now.
      engine.cancel([sequences[index]])
    return choice, choice.finish is not None

  async def completions(request: Request):
    began, status, count = time.monotonic(), 500, 0
    try:
      parsed = service.parse(await bodies.read(request, limits.max_request_bytes,
                                                limits.read_timeout))
      count = len(parsed.prompts) * parsed.n
      rid = "cmpl-" + os.urandom(12).hex()
      choices, sequences, events = start(parsed)
      if parsed.stream:
        status = 200
        return StreamingResponse(_stream(parsed, rid, choices, sequences, events),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
      gone = asyncio.ensure_future(_disconnected(request))
      try:
        ended = 0
        while ended < len(choices):
          news = asyncio.ensure_future(next_event(events, choices, sequences))
          await asyncio.wait([news, gone], return_when=asyncio.FIRST_COMPLETED)
          if not news.done():  # The client left: nothing more is decoded for it.
            news.cancel()
            status = 499
            logging.info("the client of %s left before its answer: %d sequences cancelled",
                         rid, len(sequences))
            return Response(status_code=499)
          _, over = news.result()
          ended += over
      finally:
        gone.cancel()
        engine.cancel(sequences)  # A request cut short (its client gone) frees its slots.
      body = {**head(parsed, rid), "choices": [
          {"text": (c.request.texts[c.index // parsed.n] if parsed.echo else "") + c.text,
           "index": c.index, "logprobs": c.logprobs(), "finish_reason": c.finish}
          for c in choices], "usage": usage(parsed, choices)}
      status = 200
      return JSONResponse(body)
    except Refused as e:
      status = e.status
      return e.response()
    except bodies.BadBody as e:
      status = 400
      return Refused(str(e)).response()
    except QueueFull as e:
      status = 503
      return Refused(f"the queue is full: {e}", status=503, kind="server_error",
                      code="queue_full", retry=True).response()
    except NotReady as e:
      status = 503
      return Refused(f"not ready: {e}", status=503, kind="server_error", code="not_ready",
                      retry=True).response()
    except ClientDisconnect:
      status = 400
      return Refused("the client went away before sending its request").response()
    finally:
      logging.info("POST /v1/completions %s sequences=%d latency_ms=%.1f", status, count,
                   1000 * (time.monotonic() - began))

  async def _stream(parsed, rid, choices, sequences, events):
    """Server-sent events: one per new text piece of a choice, its finish_reason in its last,
    then usage (with stream_options.include_usage) and [DONE]. A client that goes away cancels
    its sequences (Starlette cancels this generator)."""
    event = lambda body: f"data: {json.dumps(body)}\n\n"
    try:
      if parsed.echo:
        for c in choices:
          yield event({**head(parsed, rid), "choices": [
              {"text": parsed.texts[c.index // parsed.n], "index": c.index,
               "logprobs": None, "finish_reason": None}]})
      ended = 0
      while ended < len(choices):
        choice, over = await next_event(events, choices, sequences)
        if choice is None:
          continue
        text = choice.new_text()
        if over or text:
          yield event({**head(parsed, rid), "choices": [
              {"text": text, "index": choice.index,
               "logprobs": choice.logprobs(new_only=True),
               "finish_reason": choice.finish if over else None}]})
        ended += over
      if parsed.include_usage:
        yield event({**head(parsed, rid), "choices": [], "usage": usage(parsed, choices)})
      yield "data: [DONE]\n\n"
    except Refused as e:  # The server shuts down (or its decoder stopped): said, then ended.
      yield event(refusal(e.status, e.message, e.code))
      yield "data: [DONE]\n\n"
    finally:
      engine.cancel(sequences)

  async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [
        {"id": service.name, "object": "model", "created": service.created,
         "owned_by": "transformer_jax", "max_model_len": service.max_len}]})

  async def health(request: Request) -> JSONResponse:
    if engine.error is not None:
      return Refused(f"the decoder stopped: {engine.error!r}", status=500,
                      kind="server_error").response()
    return JSONResponse({"status": "ok"})

  async def ready(request: Request) -> JSONResponse:
    stats = engine.stats()
    return JSONResponse({"ready": engine.ready, "queued": stats.queued},
                        status_code=200 if engine.ready else 503)

  async def stats(request: Request) -> JSONResponse:
    return JSONResponse(dataclasses.asdict(engine.stats()))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    engine.start()
    try:
      yield
    finally:
      await asyncio.to_thread(engine.stop)
      logging.info("stopped")

  async def unknown(request: Request, exc) -> JSONResponse:  # 404 and 405, in OpenAI's shape.
    if exc.status_code == 405:
      message = f"{request.method} is not allowed on {request.url.path}"
    else:
      message = (f"no endpoint {request.method} {request.url.path}: this server answers POST "
                 "/v1/completions and GET /v1/models (no chat completions: the model is a "
                 "plain language model)")
    return JSONResponse(refusal(exc.status_code, message, "not_found" if exc.status_code == 404
                                else "method_not_allowed"), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))

  app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                          Route("/v1/models", models), Route("/health", health),
                          Route("/ready", ready), Route("/stats", stats)],
                  exception_handlers={404: unknown, 405: unknown}, lifespan=lifespan)
  def figures() -> dict[str, Figure]:  # GET /metrics (serving/metrics.py).
    done = engine.stats()
    return {
        "completion_requests": Figure("counter", "Completion requests taken", done.requests),
        "sequences": Figure("counter", "Sequences (a request's prompts times n) decoded",
                            done.sequences),
        "completion_tokens": Figure("counter", "New tokens decoded (as usage counts them: "
                                    "an ending <eos> not)", done.new_tokens),
        "positions_decoded": Figure("counter", "Positions decoded: prompts' and new tokens'",
                                    done.tokens),
        "decoder_runs": Figure("counter", "Steps the decoder ran", done.runs),
        "decode_seconds": Figure("counter", "Seconds the decoder was busy", done.busy_seconds),
        "running_sequences": Figure("gauge", "Sequences in a slot (busy slots)", done.running),
        "queued_sequences": Figure("gauge", "Sequences waiting for a slot", done.queued)}

  app.state.before_shutdown_deadline = engine.give_up  # commands/serve.py calls it.
  app.state.figures = figures
  return app
