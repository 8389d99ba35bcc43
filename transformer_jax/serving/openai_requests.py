"""OpenAI's completions requests as the completions server takes them: the fields it accepts,
each refusal in OpenAI's error shape, a request parsed and checked against the model and the
server's limits (Service.parse), and each choice's text as its tokens come (Choice: stop
strings, characters split across tokens, logprobs)."""

from __future__ import annotations

import dataclasses
import os
import re
import time

from starlette.responses import JSONResponse

from transformer_jax.data.tokenizer import BOS, EOS
from transformer_jax.decoding.lm_slots import TOP, Draw, LanguageSlots
from transformer_jax.serving import bodies
from transformer_jax.serving.lm_engine import Engine

# Fields taken, and those of OpenAI's taken only at the value that means "off".
FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
          "logprobs", "echo", "stream", "stream_options", "user")
NEUTRAL = {"best_of": 1, "frequency_penalty": 0, "presence_penalty": 0, "suffix": None,
           "logit_bias": None}
MAX_STOPS = 4
# A stop string's characters at most: every streamed event looks for the start of each one at
# the end of every choice's text (OpenAI sets no bound; 16,000 once held the server 20 s).
MAX_STOP_CHARS = 400
MAX_TEMPERATURE = 2.0


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
    if longest := max((len(s) for s in stop if len(s) > MAX_STOP_CHARS), default=0):
      raise Refused(f"a stop string has {longest} characters; the limit is {MAX_STOP_CHARS}",
                    "stop")
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
  """The length of the longest end of `text` that begins a stop string: the first place in
  text's last len(s) - 1 characters holding s's first character from which the rest of the
  text begins s (each test in C, one pass over that tail in the common case)."""
  longest = 0
  for s in stops:
    tail_start = max(len(text) - len(s) + 1, 0)
    i = text.find(s[0], tail_start)
    while i >= 0 and len(text) - i > longest:
      if s.startswith(text[i:]):
        longest = len(text) - i
        break
      i = text.find(s[0], i + 1)
  return longest
