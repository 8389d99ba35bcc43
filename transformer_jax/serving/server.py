"""A translation server over HTTP (Starlette): JSON in, translations with scores out, the
sentences of concurrent requests decoded together in decoding slots (batcher.py).

  POST /translate  {"sentences": [...], "beam_size": 4, "alpha": 1.0, "n_best": 2, "id": ...}
                   -> 200 {"translations": [{"text", "score"[, "n_best": [{"text", "score"}]]}],
                           "id": ...}
  GET  /health     -> 200 while the process serves
  GET  /ready      -> 200 once what one sentence needs is compiled (the rest compiles while
                      serving: "shapes_compiled" of "shapes"); 503 before; "queued": the
                      sentences waiting
  GET  /info       -> the model, its step and the limits
  GET  /stats      -> batches, sentences and rows decoded, and the decoders' busy seconds

Sentences are translated as `translate` does (the workdir's decoding settings, long ones
sentence by sentence). Every refusal is JSON {"error": MESSAGE}: 400 for a request that breaks
a limit or is not valid JSON or UTF-8, 503 while compiling, stopping, or when the queue is full
(with Retry-After). One log line per request: status, sentences, latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import jax
from absl import logging
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from transformer_jax.decoding import platforms, sentences as sentences_lib, streams
from transformer_jax.serving import bodies
from transformer_jax.serving.metrics import Figure
from transformer_jax.serving.batcher import Kind, NotReady, QueueFull, SlotBatcher
from transformer_jax.data.tokenizer import EOS
from transformer_jax.decoding.generation import strip
from transformer_jax.decoding.options import DecodeOptions
from transformer_jax.decoding.lines import split_to_fit
from transformer_jax.decoding.translator import Translator

FIELDS = ("sentences", "beam_size", "alpha", "n_best", "id")
MAX_ALPHA = 2.0


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the server decodes with and what it accepts."""
  beam_sizes: tuple[int, ...]  # The beam sizes a request may ask for.
  max_queue: int = 1024  # Sentences waiting, at most.
  max_request_bytes: int = 65536
  read_timeout: float = 30.0  # Seconds a request's body may take to arrive.
  max_sentences: int = 64  # Per request.
  max_sentence_chars: int = 2000
  slots: int = -1  # Decoding slots per beam size and width class (slots.py); -1: the device's.
  lanes: int = 0  # Streams of slots per beam size and width class; 0: the device's default.


class BadRequest(bodies.BadBody):
  """A request the server refuses with 400."""


def widths(max_src_len: int) -> list[int]:
  """The source widths a batch can have: multiples of 8 up to the model's max_len."""
  return list(range(8, -(-max_src_len // 8) * 8 + 1, 8))


class Service:
  """The model, its batcher and what turns a request into pieces and pieces into answers."""

  def __init__(self, translator: Translator, settings: Settings):
    self.translator, self.settings = translator, settings
    self.defaults = translator.config.decode
    self.src_lang = translator.src_lang  # Imports the datasets' module: once, not per request.
    beams = set(settings.beam_sizes)
    if self.defaults.long_beam_size:
      beams.add(self.defaults.long_beam_size)
    lanes = settings.lanes or platforms.settings(jax.default_backend()).lanes
    self.batcher = SlotBatcher(self._stream, translator.slot_widths, settings.max_queue,
                               DecodeOptions().max_len_margin, lanes=lanes)
    self.kinds = [(w, k) for k in sorted(beams) for w in widths(translator.max_src_len)]

  def _stream(self, beam_size: int, width: int) -> streams.SlotStream:
    """The slots of one beam size for sources of up to `width` tokens (their count:
    settings.slots, or the device's default)."""
    count = self.settings.slots
    if count < 0:
      count = platforms.settings(jax.default_backend()).slots(beam_size)
    options = DecodeOptions(beam_size=beam_size, beam_stop=self.defaults.beam_stop)
    return streams.SlotStream(self.translator.slot_decoder(options, count, width))

  def parse(self, body: bytes) -> tuple[list[str], DecodeOptions, int, object]:
    """(sentences, options, n_best, id) of a request body, or BadRequest naming the problem."""
    s = self.settings
    request = bodies.json_object(body, '{"sentences": ["..."]}')
    unknown = sorted(set(request) - set(FIELDS))
    if unknown:
      raise BadRequest(f"unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    lines = request.get("sentences")
    if not isinstance(lines, list) or not lines:
      raise BadRequest('"sentences" must be a non-empty list of strings')
    if len(lines) > s.max_sentences:
      raise BadRequest(f"{len(lines)} sentences; the limit is {s.max_sentences} per request "
                       "(--max_sentences)")
    for i, line in enumerate(lines):
      if not isinstance(line, str):
        raise BadRequest(f"sentences[{i}] is not a string")
      if not line.strip():
        raise BadRequest(f"sentences[{i}] is empty")
      try:
        line.encode("utf-8")
      except UnicodeEncodeError as e:  # JSON's "\ud800": a surrogate without its pair.
        raise BadRequest(f"sentences[{i}] holds a lone surrogate (character {e.start + 1}), "
                         "not text") from None
      if len(line) > s.max_sentence_chars:
        raise BadRequest(f"sentences[{i}] has {len(line)} characters; the limit is "
                         f"{s.max_sentence_chars} (--max_sentence_chars)")
    beam_size = _integer(request, "beam_size", self.defaults.beam_size)
    if beam_size not in s.beam_sizes:
      raise BadRequest(f"beam_size {beam_size} is not served; choose one of "
                       f"{', '.join(map(str, s.beam_sizes))} (--beam_sizes)")
    alpha = request.get("alpha", self.defaults.alpha)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= MAX_ALPHA:
      raise BadRequest(f"alpha must be a number from 0 to {MAX_ALPHA}, got {alpha!r}")
    n_best = _integer(request, "n_best", 0)
    if not 0 <= n_best <= beam_size:
      raise BadRequest(f"n_best {n_best} must be from 0 (off) to the beam size ({beam_size})")
    options = DecodeOptions(beam_size=beam_size, alpha=float(alpha),
                            beam_stop=self.defaults.beam_stop)
    return lines, options, n_best, request.get("id")

  def prepare(self, body: bytes):
    """(sentences, options, n_best, id, pieces, their lines) of a request body (`parse`, then
    `pieces`), or BadRequest."""
    lines, options, n_best, request_id = self.parse(body)
    pieces, owners = self.pieces(lines, options, whole=bool(n_best))
    if len(pieces) > self.settings.max_queue:
      raise BadRequest(f"the request makes {len(pieces)} sentences to decode (long lines are "
                       f"split); the queue holds {self.settings.max_queue} (--max_queue)")
    return lines, options, n_best, request_id, pieces, owners

  def pieces(self, lines: list[str], options: DecodeOptions,
             whole: bool) -> tuple[list[tuple[list[int], Kind]], list[int]]:
    """The pieces to decode ((ids with <eos>, kind) each) and the line each came from: long
    lines split into sentences and over-long ones cut to fit unless `whole` (translate's rules:
    split_to_fit); a whole line over the model's max_len (an n_best request's) refused."""
    tokenizer, d = self.translator.tokenizers.src, self.defaults
    limit = self.translator.max_src_len
    if whole:  # n-best lists rank whole translations: a line is one piece.
      texts, owners = lines, list(range(len(lines)))
    else:
      texts, owners = split_to_fit(self.translator, lines,
                                   None if d.segment_over < 0 else d.segment_over)
    out = []
    for owner, ids in zip(owners, tokenizer.encode(texts)):
      ids = [*ids, EOS]
      if len(ids) > limit:  # Only a whole line (n_best) can be.
        raise BadRequest(f"sentences[{owner}] has {len(ids)} tokens with <eos>, over the "
                         f"model's max_len, {limit}: an n_best request translates a sentence "
                         "whole; send it without n_best to have it translated in pieces")
      beam_size = options.beam_size
      if d.long_beam_size and not whole and len(ids) > d.long_over:
        beam_size = d.long_beam_size
      out.append((ids, Kind(-(-len(ids) // 8) * 8, beam_size, options.alpha)))
    return out, owners

  def answer(self, results, owners: list[int], count: int, n_best: int) -> list[dict]:
    """The response's translations: pieces' best outputs joined per line (scores summed)."""
    decode = lambda tokens: self.translator.tokenizers.tgt.decode(strip(tokens))
    texts = [decode(tokens[0]) for tokens, _ in results]
    joined = sentences_lib.join(texts, owners, count)
    scores = [0.0] * count
    for (_, score), owner in zip(results, owners):
      scores[owner] += float(score[0])
    out = [{"text": text, "score": score} for text, score in zip(joined, scores)]
    if n_best:  # Lines are whole then: one piece each.
      for entry, (tokens, score) in zip(out, results):
        entry["n_best"] = [{"text": decode(tokens[j]), "score": float(score[j])}
                           for j in range(n_best)]
    return out


def _integer(request: dict, name: str, default: int) -> int:
  value = request.get(name, default)
  if isinstance(value, bool) or not isinstance(value, int):
    raise BadRequest(f"{name} must be an integer, got {value!r}")
  return value


def refusal(status: int, message: str, code: str) -> dict:
  """This server's error body (serving/guard.py's refusals too)."""
  return {"error": message}


def _error(status: int, message: str, **headers) -> JSONResponse:
  return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def create_app(service: Service) -> Starlette:
  """The ASGI application; its lifespan starts the batcher (compiling in the background) and,
  at shutdown, drains it."""
  batcher, settings = service.batcher, service.settings

  async def translate(request: Request) -> JSONResponse:
    start = time.monotonic()
    count = 0
    response = None
    try:
      body = await bodies.read(request, settings.max_request_bytes, settings.read_timeout)
      # Parsing, splitting into sentences and tokenizing take seconds for a large request of
      # many lines: off the event loop, which answers every other client meanwhile.
      lines, options, n_best, request_id, pieces, owners = await asyncio.to_thread(
          service.prepare, body)
      count = len(lines)
      job = batcher.submit(pieces)
      results = await asyncio.wrap_future(job.future)
      body = {"translations": await asyncio.to_thread(service.answer, results, owners, count,
                                                      n_best)}
      if request_id is not None:
        body["id"] = request_id
      response = JSONResponse(body)
    except bodies.BadBody as e:  # BadRequest too.
      response = _error(400, str(e))
    except QueueFull as e:
      response = _error(503, f"the queue is full: {e}", **{"Retry-After": "1"})
    except NotReady as e:
      response = _error(503, f"not ready: {e}", **{"Retry-After": "1"})
    except ClientDisconnect:
      response = _error(400, "the client went away before sending its request")
    finally:
      status = response.status_code if response is not None else 500
      logging.info("POST /translate %s sentences=%d latency_ms=%.1f queued=%d", status, count,
                   1000 * (time.monotonic() - start), batcher.queued())
    return response

  async def health(request: Request) -> JSONResponse:
    if batcher.error is not None:
      return _error(500, f"the decoder stopped: {batcher.error!r}")
    return JSONResponse({"status": "ok"})

  async def ready(request: Request) -> JSONResponse:
    body = {"ready": batcher.ready, "shapes_compiled": batcher.shapes_done,
            "shapes": batcher.shapes_total, "queued": batcher.queued()}
    return JSONResponse(body, status_code=200 if batcher.ready else 503)

  async def info(request: Request) -> JSONResponse:
    t = service.translator
    return JSONResponse({
        "step": t.step, "max_len": t.max_src_len, "source_language": t.src_lang,
        "decode": dataclasses.asdict(service.defaults),
        "settings": dataclasses.asdict(settings)})

  async def stats(request: Request) -> JSONResponse:
    return JSONResponse(dataclasses.asdict(batcher.stats()))

  @contextlib.asynccontextmanager
  async def lifespan(app):
    batcher.start(service.kinds, first_beam=service.defaults.beam_size)
    try:
      yield
    finally:
      await asyncio.to_thread(batcher.stop)
      logging.info("stopped: every accepted request was answered")

  def figures() -> dict[str, Figure]:  # GET /metrics (serving/metrics.py).
    done = batcher.stats()
    return {
        "sentences_decoded": Figure("counter", "Sentences decoded (each part of a source split "
                                    "into sentences counted)", done.sentences),
        "decoder_runs": Figure("counter", "Batches the decoders ran", done.batches),
        "rows_decoded": Figure("counter", "Rows decoded, a beam's rows and padding included",
                               done.rows),
        "decode_seconds": Figure("counter", "Seconds the decoder threads were busy, summed",
                                 done.decode_s),
        "queued_sentences": Figure("gauge", "Sentences waiting for a decoder",
                                   batcher.queued()),
        "shapes_compiled": Figure("gauge", "Decoder shapes ready, of shapes_planned",
                                  batcher.shapes_done),
        "shapes_planned": Figure("gauge", "Decoder shapes this server compiles",
                                 batcher.shapes_total)}

  app = Starlette(routes=[Route("/translate", translate, methods=["POST"]),
                          Route("/health", health), Route("/ready", ready), Route("/info", info),
                          Route("/stats", stats)],
                  lifespan=lifespan)
  app.state.figures = figures
  return app

