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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import re
import threading
import time

from absl import logging
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from transformer_jax.data.tokenizer import BOS, EOS
from transformer_jax.decoding.lm_slots import TOP, Draw, LanguageSlots
from transformer_jax.serving import bodies
from transformer_jax.serving.batcher import NotReady, QueueFull
from transformer_jax.serving.metrics import Figure

# Fields taken, and those of OpenAI's taken only at the value that means "off".
FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
          "logprobs", "echo", "stream", "stream_options", "user")
NEUTRAL = {"best_of": 1, "frequency_penalty": 0, "presence_penalty": 0, "suffix": None,
           "logit_bias": None}
MAX_STOPS = 4
MAX_TEMPERATURE = 2.0
STEPS_PER_RUN = 4  # Decoder steps between two looks of the host: a stream's pieces come this often.


class Refused(Exception):
  """A refusal in OpenAI's shape."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error", code: str | None = None, retry: bool = False):
    super().__init__(message)
    self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
    self.retry = retry

  def response(self) -> JSONResponse:
    body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}
    return JSONResponse(body, status_code=self.status,
                        headers={"Retry-After": "1"} if self.retry else None)


async def _disconnected(request: Request) -> None:
  """Returns once the client of a request whose body was read has gone (ASGI's
  http.disconnect); a non-streaming answer is otherwise computed whole for nobody."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def refusal(status: int, message: str, code: str | None = None) -> dict:
  """OpenAI's error body (serving/guard.py's refusals too)."""
  kind = "invalid_request_error" if status < 500 else "server_error"
  return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  max_queue: int = 1024  # Sequences waiting, at most.
  max_request_bytes: int = 65536
  read_timeout: float = 30.0  # Seconds a request's body may take to arrive.
  max_sequences: int = 64  # Prompts times n, per request.
  max_prompt_chars: int = 2000


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A parsed completions request."""
  prompts: list[list[int]]  # <bos> + each prompt's ids.
  texts: list[str]
  max_tokens: int
  n: int
  draw: Draw  # item unset: each sequence's is its choice index.
  stop: tuple[str, ...]
  logprobs: int | None
  echo: bool
  stream: bool
  include_usage: bool


class Sequence:
  """One choice being decoded: what the engine thread tells of it goes to its request's asyncio
  queue as (index, new positions [(token, logprob, top ids, top log-probabilities)], end)."""

  def __init__(self, index: int, ids: list[int], max_new: int, draw: Draw, scored: bool,
               events, loop):
    self.index, self.ids, self.max_new, self.draw = index, ids, max_new, draw
    self.scored = scored  # Whether its positions' log-probabilities are kept (logprobs).
    self._events, self._loop = events, loop
    self.cancelled = False

  def tell(self, positions, end: str | None) -> None:
    self._loop.call_soon_threadsafe(self._events.put_nowait, (self.index, positions, end))


@dataclasses.dataclass
class Stats:
  requests: int = 0
  sequences: int = 0
  tokens: int = 0  # Positions decoded: prompts' and new tokens'.
  new_tokens: int = 0
  runs: int = 0
  busy_seconds: float = 0.0
  running: int = 0
  queued: int = 0


class Engine:
  """The thread that drives one LanguageSlots: it compiles its programs (then `ready`), puts
  queued sequences into free slots between runs, drops cancelled ones, and tells each sequence
  its new tokens after every run."""

  def __init__(self, slots: LanguageSlots, max_queue: int):
    self.slots, self.max_queue = slots, max_queue
    self._pending: collections.deque[Sequence] = collections.deque()
    self._live: dict[int, Sequence] = {}
    self._told: dict[int, int] = {}  # Slot -> positions told so far (its next one to tell).
    self._wake = threading.Condition()
    self._stopping = False
    self.ready = False
    self.error: BaseException | None = None
    self._stats = Stats()
    self._thread = threading.Thread(target=self._main, name="completions", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    with self._wake:
      self._stopping = True
      self._wake.notify_all()
    self._thread.join()

  def submit(self, sequences: list[Sequence]) -> None:
    with self._wake:
      if self.error is not None:
        raise NotReady(f"the decoder stopped: {self.error!r}")
      if not self.ready or self._stopping:
        raise NotReady("stopping" if self._stopping else "still compiling (GET /ready says when)")
      if len(self._pending) + len(sequences) > self.max_queue:
        raise QueueFull(f"{len(self._pending)} sequences wait and the queue holds "
                        f"{self.max_queue} (--max_queue)")
      self._pending.extend(sequences)
      self._stats.requests += 1
      self._wake.notify_all()

  def give_up(self) -> None:
    """Tells every running and queued sequence that the server is shutting down (its request
    is then answered 503, its stream ends with an error and [DONE]), and stops decoding: what
    a server does before its shutdown time runs out, so that no request is cut off unanswered."""
    with self._wake:
      for sequence in [*self._live.values(), *self._pending]:
        sequence.tell([], "shutdown")
      self._live.clear()
      self._pending.clear()
      self._stopping = True
      self._wake.notify_all()

  def cancel(self, sequences: list[Sequence]) -> None:
    """Ends these sequences (a stop string met, a client gone): their slots free at the next
    look, those still queued never start."""
    with self._wake:
      for sequence in sequences:
        sequence.cancelled = True
      self._wake.notify_all()

  def stats(self) -> Stats:
    with self._wake:
      return dataclasses.replace(self._stats, running=len(self._live), queued=len(self._pending))

  def _main(self) -> None:
    try:
      if self.slots.compile(stopping=lambda: self._stopping):
        logging.info("ready: %d slots of up to %d positions compiled", self.slots.slots,
                     self.slots.max_len)
        self.ready = True
        self._loop()
    except BaseException as e:  # Told to every request: /health says so too.
      logging.exception("the decoder stopped")
      with self._wake:
        self.error = e
        for sequence in [*self._live.values(), *self._pending]:
          sequence.tell([], "error")
        self._live.clear()
        self._pending.clear()

  def _take(self):
    """Under the lock: (starts, drops) for the next admit; waits while nothing runs."""
    while not self._stopping and not self._pending and not self._live:
      self._wake.wait()
    drops = [slot for slot, s in self._live.items() if s.cancelled]
    for slot in drops:
      del self._live[slot]
    starts = {}
    free = (slot for slot in range(self.slots.slots) if slot not in self._live)
    while self._pending:
      sequence = self._pending[0]
      if sequence.cancelled:
        self._pending.popleft()
        continue
      slot = next(free, None)
      if slot is None:
        break
      self._pending.popleft()
      self._live[slot], self._told[slot] = sequence, 1  # Position 0 is <bos>.
      starts[slot] = (sequence.ids, sequence.max_new, sequence.draw, sequence.scored)
      self._stats.sequences += 1
    return starts, drops

  def _loop(self) -> None:
    state = self.slots.empty()
    while True:
      with self._wake:
        starts, drops = self._take()
        if self._stopping:
          for sequence in [*self._live.values(), *self._pending]:
            sequence.tell([], "cancelled")
          return
        live = dict(self._live)
      if starts or drops:
        state = self.slots.admit(state, starts, drops)
      if not live:
        continue
      rows = next(r for r in self.slots.run_sizes if r > max(live))
      began = time.monotonic()
      state, view = self.slots.run(state, rows, STEPS_PER_RUN)
      told = [self._tell(slot, sequence, view) for slot, sequence in live.items()]
      with self._wake:
        self._stats.runs += 1
        self._stats.busy_seconds += time.monotonic() - began
        self._stats.tokens += sum(positions for positions, _ in told)
        self._stats.new_tokens += sum(new for _, new in told)
        for slot in live:
          if bool(view["done"][slot]) and self._live.get(slot) is live[slot]:
            del self._live[slot]

  def _tell(self, slot: int, sequence: Sequence, view) -> tuple[int, int]:
    """Tells `sequence` its positions written since last told: (those, its new tokens)."""
    if sequence.cancelled:
      return 0, 0
    last = int(view["t"][slot])  # The last position written.
    first = self._told[slot]
    tokens = view["tokens"][slot, first:last + 1].tolist()
    if sequence.scored:
      positions = [(token, float(view["logprob"][slot, p]), view["top_ids"][slot, p].tolist(),
                    view["top_lp"][slot, p].tolist()) for p, token in enumerate(tokens, first)]
    else:
      positions = [(token, 0.0, [], []) for token in tokens]
    self._told[slot] = last + 1
    end = None
    if bool(view["done"][slot]):
      end = "stop" if positions and positions[-1][0] == EOS else "length"
    if positions or end:
      sequence.tell(positions, end)
    return len(positions), max(0, last + 1 - max(first, len(sequence.ids)))


class Service:
  """The model, its engine and what turns requests into sequences and sequences into answers."""

  def __init__(self, completer, slots: int, limits: Limits, name: str, programs):
    self.completer, self.limits, self.name = completer, limits, name
    self.tokenizer, self.max_len = completer.tokenizer, completer.max_len
    self.engine = Engine(LanguageSlots(completer.model, completer.params, slots, self.max_len,
                                       self.tokenizer.vocab_size, programs), limits.max_queue)
    # A byte piece (<0xC3>: part of a character the vocabulary lacks) as OpenAI shows one.
    self._pieces = [f"bytes:\\x{p[3:5].lower()}" if re.fullmatch(r"<0x[0-9A-F]{2}>", p)
                    else p.replace("\u2581", " ") for p in self.tokenizer.pieces()]
    self.created = int(time.time())

  def parse(self, body: bytes) -> Parsed:
    """The request of a body, or Refused (bodies.BadBody for the body itself) naming the
    problem."""
    request = bodies.json_object(body, '{"model": ..., "prompt": ...}')
    for name in request:
      if name in NEUTRAL:
        if request[name] != NEUTRAL[name]:
          raise Refused(f"{name} is not supported by this server (only {NEUTRAL[name]!r})",
                         name, code="unsupported_parameter")
      elif name not in FIELDS:
        raise Refused(f"unknown field {name!r}; this server takes {', '.join(FIELDS)}", name,
                       code="unknown_parameter")
    model = request.get("model")
    if model != self.name:
      raise Refused(f"the model {model!r} is not served here; GET /v1/models lists "
                     f"{self.name!r}", "model", status=404, code="model_not_found")
    texts = request.get("prompt")
    if isinstance(texts, str):
      texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
      raise Refused("prompt must be a string or a non-empty list of strings", "prompt")
    for i, text in enumerate(texts):
      if len(text) > self.limits.max_prompt_chars:
        raise Refused(f"prompt {i} has {len(text)} characters; the limit is "
                       f"{self.limits.max_prompt_chars} (--max_sentence_chars)", "prompt")
      try:
        text.encode("utf-8")
      except UnicodeEncodeError as e:
        raise Refused(f"prompt {i} holds a lone surrogate (character {e.start + 1}), not "
                       "text", "prompt") from None
    n = _number(request, "n", 1, int, 1, self.limits.max_sequences)
    if len(texts) * n > self.limits.max_sequences:
      raise Refused(f"{len(texts)} prompts x n={n} make {len(texts) * n} sequences; the limit "
                     f"is {self.limits.max_sequences} per request (--max_sentences)", "n")
    max_tokens = _number(request, "max_tokens", 16, int, 1, self.max_len)
    prompts = [[BOS, *ids] for ids in self.tokenizer.encode(texts)]
    for i, ids in enumerate(prompts):
      room = self.max_len - len(ids)
      if room < max_tokens:
        raise Refused(
            f"prompt {i} has {len(ids) - 1} tokens and max_tokens is {max_tokens}: the model "
            f"holds {self.max_len} positions (data.max_len), <bos> included, so at most "
            f"{max(room, 0)} new tokens fit", "max_tokens" if room > 0 else "prompt",
            code="context_length_exceeded")
    temperature = _number(request, "temperature", 1.0, float, 0.0, MAX_TEMPERATURE)
    top_p = _number(request, "top_p", 1.0, float, 0.0, 1.0)
    if top_p <= 0:
      raise Refused(f"top_p must be in (0, 1], got {top_p}", "top_p")
    vocab = self.tokenizer.vocab_size
    top_k = _number(request, "top_k", 0, int, 0, vocab)
    seed = request.get("seed")
    if seed is None:
      seed = int.from_bytes(os.urandom(4), "little")
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 32:
      raise Refused(f"seed must be an integer from 0 to 2**32 - 1, got {seed!r}", "seed")
    stop = request.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if (not isinstance(stop, list) or len(stop) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stop)):
      raise Refused(f"stop must be a string or a list of at most {MAX_STOPS} non-empty "
                     "strings", "stop")
    logprobs = request.get("logprobs")
    if logprobs is not None:
      logprobs = _number(request, "logprobs", 0, int, 0, TOP)
    options = request.get("stream_options")
    stream = _flag(request, "stream")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
      raise Refused('stream_options must be {"include_usage": true or false}, with stream',
                     "stream_options")
    return Parsed(prompts=prompts, texts=texts, max_tokens=max_tokens, n=n,
                    draw=Draw(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                    stop=tuple(stop), logprobs=logprobs, echo=_flag(request, "echo"),
                    stream=stream,
                    include_usage=bool((options or {}).get("include_usage", False)))

  def token_text(self, token: int) -> str:
    return self._pieces[token] if token >= 0 else ""


def _number(request: dict, name: str, default, kind, low, high):
  value = request.get(name, default)
  if value is None:
    value = default
  ok = not isinstance(value, bool) and (isinstance(value, int) if kind is int
                                        else isinstance(value, (int, float)))
  if not ok or not low <= value <= high:
    what = "an integer" if kind is int else "a number"
    raise Refused(f"{name} must be {what} from {low} to {high}, got {value!r}", name)
  return kind(value)


def _flag(request: dict, name: str) -> bool:
  value = request.get(name, False)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise Refused(f"{name} must be true or false, got {value!r}", name)
  return value


class Choice:
  """One choice's text as its tokens come: the new text each brings (held back while it may be
  the start of a stop string, or ends inside a character), cut at the first stop string."""

  def __init__(self, service: Service, request: Parsed, index: int):
    self.service, self.request, self.index = service, request, index
    self.prompt = request.prompts[index // request.n]
    self.ids: list[int] = []
    self.text = ""  # Decoded so far (cut at a stop string).
    self.sent = 0  # Characters handed out.
    self.finish: str | None = None
    self.entries: list[tuple[int, float, list, list]] = []  # For logprobs.
    self.sent_entries = 0  # Entries handed out (a stream's logprobs).

  def add(self, positions, end: str | None) -> None:
    """Takes positions told by the engine (the prompt's, then new tokens')."""
    for position in positions:
      if len(self.entries) < len(self.prompt) - 1:  # A prompt token's.
        self.entries.append(position)
        continue
      if position[0] == EOS:
        break
      self.ids.append(position[0])
      self.entries.append(position)
    if self.finish is None:
      self.text = self.service.tokenizer.decode(self.ids)
      cut = _first_stop(self.text, self.request.stop)
      if cut is not None:
        self.text, self.finish = self.text[:cut], "stop"
        # The tokens end with the one the stop string begins in (or before it, where it
        # begins on a token's first character): none after is the choice's.
        kept = next(k for k in range(len(self.ids) + 1)
                    if len(self._decoded(self.ids[:k])) >= cut)
        self.ids = self.ids[:kept]
        del self.entries[len(self.prompt) - 1 + kept:]
      elif end is not None:
        self.finish = end

  def _decoded(self, ids: list[int]) -> str:
    """The text of ids, less a character whose bytes have not all come."""
    return self.service.tokenizer.decode(ids).rstrip("\ufffd")

  def new_text(self) -> str:
    """The text not handed out yet that is sure to stay."""
    keep = len(self.text)
    if self.finish is None:
      if self.text.endswith("\ufffd"):  # A character whose bytes are still coming.
        keep = len(self.text.rstrip("\ufffd"))
      keep -= _stop_prefix(self.text[:keep], self.request.stop)
    piece = self.text[self.sent:keep] if keep > self.sent else ""
    self.sent += len(piece)
    return piece

  @property
  def new_tokens(self) -> int:
    return len(self.ids)

  def logprobs(self, new_only: bool = False):
    """OpenAI's logprobs object of every entry (of those not handed out yet with `new_only`: a
    stream's), the prompt's with echo; None where the request asks for none. text_offset counts
    from the start of the choice's text."""
    request = self.request
    if request.logprobs is None:
      return None
    first = self.sent_entries if new_only else 0
    if not request.echo:
      first = max(first, len(self.prompt) - 1)
    entries, self.sent_entries = self.entries[first:], len(self.entries)
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for j, (token, logprob, top_ids, top_lp) in enumerate(entries, first):
      tokens.append(self.service.token_text(token))
      token_logprobs.append(logprob)
      tops.append({self.service.token_text(i): lp
                   for i, lp in zip(top_ids[:request.logprobs], top_lp)})
      offsets.append(self._offset(j))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}

  def _offset(self, j: int) -> int:
    """Where entry j's token begins in the choice's text (the prompt's, with echo, then the
    completion's), in characters: the length of the text of the tokens before it."""
    read = len(self.prompt) - 1  # The prompt's tokens after <bos>.
    if j < read:
      return len(self._decoded(self.prompt[1:1 + j]))
    echoed = len(self.request.texts[self.index // self.request.n]) if self.request.echo else 0
    return echoed + min(len(self._decoded(self.ids[:j - read])), len(self.text))


def _first_stop(text: str, stops) -> int | None:
  found = [i for i in (text.find(s) for s in stops) if i >= 0]
  return min(found) if found else None


def _stop_prefix(text: str, stops) -> int:
  """The length of the longest end of `text` that begins a stop string."""
  return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])] or [0])


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
        "completion_tokens": Figure("counter", "New tokens decoded", done.new_tokens),
        "positions_decoded": Figure("counter", "Positions decoded: prompts' and new tokens'",
                                    done.tokens),
        "decoder_runs": Figure("counter", "Steps the decoder ran", done.runs),
        "decode_seconds": Figure("counter", "Seconds the decoder was busy", done.busy_seconds),
        "running_sequences": Figure("gauge", "Sequences in a slot (busy slots)", done.running),
        "queued_sequences": Figure("gauge", "Sequences waiting for a slot", done.queued)}

  app.state.before_shutdown_deadline = engine.give_up  # commands/serve.py calls it.
  app.state.figures = figures
  return app
