"""Serves a trained workdir's model over HTTP (docs/serving.md): a translation model's
translations, a language model's completions through OpenAI's API.

  python -m transformer_jax serve --workdir runs/fra_eng --port 8080
  curl -s localhost:8080/ready
  curl -s localhost:8080/translate -H 'Content-Type: application/json' \
      -d '{"sentences": ["I lost.", "I am home."]}'

  python -m transformer_jax serve --workdir runs/lm_shakespeare --port 8080
  curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "lm_shakespeare", "prompt": "ROMEO."}'

The sentences (or sequences) of concurrent requests are decoded together in decoding slots,
which each enters as it comes and leaves as its search ends (continuous batching). GET /ready
answers 200 once what one request needs is compiled (a translation server compiles the other
programs while it serves). SIGTERM (or Ctrl-C) stops taking requests, answers those already
taken, and exits 0.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import asyncio  # noqa: E402
import logging as std_logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from transformer_jax import errors  # noqa: E402
from transformer_jax.commands import launch
from transformer_jax.errors import UserError  # noqa: E402


class ServeError(UserError, ValueError):
  """A flag the server cannot start with."""


def define_flags() -> None:
  flags.DEFINE_multi_string("workdir", None, "Training workdir; given more than once, an "
                            "ensemble (as translate).")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the newest that verifies.")
  flags.DEFINE_bool("ema", True, "Decode with the parameters' moving average where the run kept "
                    "one.")
  flags.DEFINE_bool("int8", False, "A translation model's products in int8 (as translate "
                    "--int8).")
  flags.DEFINE_bool("shortlist", False, "A translation model's steps projected onto the "
                    "vocabulary shortlist of the sources decoding at once (as translate "
                    "--shortlist).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
  flags.DEFINE_integer("port", 8080, "Port to listen on.")
  flags.DEFINE_list("beam_sizes", None, "Beam sizes a request may ask for, each compiled at "
                    "start-up; default: 1 and the workdir's decode.beam_size.")
  flags.DEFINE_string("slots", "auto", "Decoding slots per beam size and source-width class: "
                      "'auto' (as many as suit this device and beam size) or a count. A "
                      "request's sentences enter free slots as they come and leave as their "
                      "searches end (docs/serving.md). A language model's: its count of "
                      "sequences decoded at once.")
  flags.DEFINE_integer("lanes", 0, "Streams of slots serving each beam size and source-width "
                       "class at once, each driven by a thread of its own; 0: as many as suit "
                       "this device (2 on a CPU, whose cores one stream's small steps leave "
                       "partly idle; 1 on an accelerator).")
  flags.DEFINE_integer("max_queue", 1024, "Sentences (a language model's sequences) waiting "
                       "at most; a request that would overflow the queue gets 503 with "
                       "Retry-After.")
  flags.DEFINE_integer("max_connections", 512, "Open connections at most (uvicorn's "
                       "limit_concurrency): one more is answered 503 at once.")
  flags.DEFINE_integer("max_request_bytes", 65536, "Largest request body.")
  flags.DEFINE_float("read_timeout", 30.0, "Seconds a request's head (its request line and "
                     "headers, at most 16 KB) and then its body may each take to arrive: a "
                     "slower client's connection is closed (head) or answered 400 (body).")
  flags.DEFINE_integer("max_sentences", 64, "Most sentences in one request (a language "
                       "model's: prompts times n).")
  flags.DEFINE_integer("max_sentence_chars", 2000, "Longest sentence (or prompt), in "
                       "characters.")
  flags.DEFINE_float("shutdown_timeout", 30.0, "On SIGTERM or SIGINT, seconds to wait for the "
                     "open requests to finish (queued sentences are decoded and answered) "
                     "before the connections still open, such as a client stalled halfway "
                     "through sending its request, are closed.")
  flags.DEFINE_string("model_name", None, "The model's name in OpenAI's API (a language model's "
                      "requests name it; GET /v1/models lists it); default: the workdir's "
                      "folder name.")
  flags.DEFINE_string("api_key", None, "Requests must send 'Authorization: Bearer KEY' (as "
                      "OpenAI's clients send their api_key); /health and /ready stay open. "
                      "Default: $TRANSFORMER_JAX_API_KEY where set, else no key.")
  flags.DEFINE_list("allowed_hosts", None, "Host names requests may address besides the "
                    "loopback ones (a server on --host 127.0.0.1 answers 127.0.0.1, localhost "
                    "and ::1 only, so that no web page can reach it by DNS rebinding; on "
                    "another --host, any name unless this lists them).")
  flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache (a "
                      "restart then compiles nothing); default: the training run's "
                      "(run.compilation_cache_dir, or WORKDIR/jax_cache).")


def _listen(host: str, port: int) -> socket.socket:
  """The listening socket, bound before the model is loaded: the address is this server's from
  then on (a second server started at the same time gets a one-line error, not a bind failure
  after its model loaded)."""
  if not 0 < port < 65536:
    raise ServeError(f"--port must be from 1 to 65535, got {port}")
  try:
    return socket.create_server((host, port), backlog=2048)
  except OSError as e:
    raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}") from None


class _QuietCancellation(std_logging.Filter):
  """Drops uvicorn's traceback of a request it cancels at shutdown (after --shutdown_timeout,
  or at a second signal): the cancellation is the intended end, and uvicorn says in one line how
  many it cancelled."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def main(argv):
  FLAGS = flags.FLAGS
  with errors.reported():
    if len(argv) > 1:
      raise ServeError(f"unexpected arguments {argv[1:]}: sentences come in requests")
    if not FLAGS.workdir:
      raise ServeError("--workdir is required")
    for name in ("max_queue", "max_connections", "max_request_bytes", "max_sentences",
                 "max_sentence_chars"):
      if getattr(FLAGS, name) < 1:
        raise ServeError(f"--{name} must be at least 1, got {getattr(FLAGS, name)}")
    if FLAGS.max_queue < FLAGS.max_sentences:
      raise ServeError(f"--max_queue {FLAGS.max_queue} is below --max_sentences "
                       f"{FLAGS.max_sentences}: a full request could never be queued")
    if FLAGS.lanes < 0:
      raise ServeError(f"--lanes must be 0 (the device's) or positive, got {FLAGS.lanes}")
    if FLAGS.slots != "auto" and not (FLAGS.slots.isdigit() and int(FLAGS.slots) > 0):
      raise ServeError(f"--slots must be 'auto' or a count of at least 1, got {FLAGS.slots!r}")
    if not FLAGS.read_timeout > 0:
      raise ServeError(f"--read_timeout must be positive (seconds), got {FLAGS.read_timeout}")
    if not FLAGS.shutdown_timeout > 0:
      raise ServeError(f"--shutdown_timeout must be positive (seconds), got "
                       f"{FLAGS.shutdown_timeout}")
    try:
      beam_sizes = tuple(sorted({int(b) for b in FLAGS.beam_sizes or ()}))
    except ValueError:
      raise ServeError(f"--beam_sizes must be integers, got {FLAGS.beam_sizes}") from None
    if any(b < 1 for b in beam_sizes):
      raise ServeError(f"--beam_sizes must be at least 1, got {FLAGS.beam_sizes}")
    _api_key(FLAGS)  # Before the checkpoint is read.
    try:  # The server's libraries: imported once the flags are known good.
      import uvicorn
      import starlette  # noqa: F401
      import prometheus_client  # noqa: F401
    except ImportError as e:
      raise ServeError(f"serve needs the serve extra ({e.name} is not installed): pip install "
                       "'.[serve]' in the project's folder") from None
    from transformer_jax.programs import ProgramStore
    from transformer_jax.runs.workdir import Workdir
    for workdir in FLAGS.workdir:
      Workdir(workdir).check_family(("encoder_decoder", "decoder_only"), "serve")
    language = Workdir(FLAGS.workdir[0]).model_kind() == "decoder_only"
    if language and len(FLAGS.workdir) > 1:
      raise ServeError(f"--workdir is given {len(FLAGS.workdir)} times: ensembles are served "
                       "for translation models only")
    if language and FLAGS.beam_sizes:
      raise ServeError("--beam_sizes: a language model's completions are greedy or sampled, "
                       "without beam search")
    listening = _listen(FLAGS.host, FLAGS.port)

    config = Workdir(FLAGS.workdir[0]).load_config()
    launch.keep_freed_memory()
    cache = launch.use_compilation_cache(FLAGS.workdir[0], FLAGS.compilation_cache_dir)
    programs = ProgramStore(cache and cache / "programs")
    slots = -1 if FLAGS.slots == "auto" else int(FLAGS.slots)
    if language:
      app_ = _completions_app(FLAGS, slots, programs)
    else:
      app_ = _translation_app(FLAGS, config, beam_sizes, slots, programs)
    give_up = getattr(app_.state, "before_shutdown_deadline", None)
    from transformer_jax.serving.metrics import Metrics
    app_ = Metrics(app_, app_.state.figures, programs,
                   guard=lambda inner: _guarded(inner, FLAGS, language))
    from transformer_jax.serving.protocol import with_head_timeout
    server = _server(give_up, FLAGS.shutdown_timeout, uvicorn.Config(
        app_, host=FLAGS.host, port=FLAGS.port, http=with_head_timeout(FLAGS.read_timeout),
        log_level="warning",
        access_log=False, lifespan="on", timeout_graceful_shutdown=FLAGS.shutdown_timeout,
        limit_concurrency=FLAGS.max_connections))
    # uvicorn drains on SIGTERM or SIGINT, then raises the signal again: answered here, so that
    # a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: None)
    logging.info("serving on http://%s:%d once what one request needs is compiled (GET /ready "
                 "says when)", FLAGS.host, FLAGS.port)
    std_logging.getLogger("uvicorn.error").addFilter(_QuietCancellation())
    server.run(sockets=[listening])
    logging.info("shut down")


def _server(give_up, timeout: float, config):
  """uvicorn's server; where the app has `give_up` (the completions engine's), it is called
  shortly before `timeout` seconds after the first SIGTERM or SIGINT run out, so that the
  requests still waiting are answered 503 and the streams end with [DONE] instead of being
  cut off when uvicorn cancels them."""
  import threading
  import uvicorn

  class Server(uvicorn.Server):
    timer = None

    def handle_exit(self, sig, frame) -> None:
      super().handle_exit(sig, frame)
      if give_up is not None and self.timer is None:
        self.timer = threading.Timer(max(0.8 * timeout, timeout - 2.0), give_up)
        self.timer.daemon = True
        self.timer.start()

  return Server(config)


def _api_key(FLAGS) -> str | None:
  """The key requests must send (None: none), refused where it is empty."""
  key = FLAGS.api_key if FLAGS.api_key is not None else os.environ.get("TRANSFORMER_JAX_API_KEY")
  if key is not None and not key.strip():
    raise ServeError("--api_key (or TRANSFORMER_JAX_API_KEY) is empty: give a key, or unset it")
  return key


def _guarded(app_, FLAGS, language: bool):
  """The app behind serving/guard.py's checks: the API key, the Host names, JSON bodies."""
  from transformer_jax.serving import guard
  if language:
    from transformer_jax.serving.openai_requests import refusal
  else:
    from transformer_jax.serving.server import refusal
  key = _api_key(FLAGS)
  hosts = guard.loopback_hosts(FLAGS.host)
  if FLAGS.allowed_hosts:
    hosts = (*(hosts or ()), *FLAGS.allowed_hosts)
  if key is None and hosts is None:
    logging.warning("listening on %s without --api_key: anyone who can reach port %d can use "
                    "this server", FLAGS.host, FLAGS.port)
  return guard.Guard(app_, key and key.strip(), hosts, refusal)


def _translation_app(FLAGS, config, beam_sizes, slots, programs):
  from transformer_jax.serving.server import Service, Settings, create_app
  from transformer_jax.decoding.translator import Translator
  default_beam = config.decode.beam_size
  settings = Settings(
      beam_sizes=beam_sizes or tuple(sorted({1, default_beam})),
      max_queue=FLAGS.max_queue, max_request_bytes=FLAGS.max_request_bytes,
      max_sentences=FLAGS.max_sentences, max_sentence_chars=FLAGS.max_sentence_chars,
      slots=slots, lanes=FLAGS.lanes, read_timeout=FLAGS.read_timeout)
  if default_beam not in settings.beam_sizes:
    raise ServeError(f"--beam_sizes {FLAGS.beam_sizes} leaves out the workdir's default beam "
                     f"size ({default_beam}), which requests without beam_size get")
  from transformer_jax.decoding.shortlist import for_workdir
  translator = Translator(FLAGS.workdir, FLAGS.step, ema=FLAGS.ema, programs=programs,
                          int8_weights=FLAGS.int8,
                          shortlist=for_workdir(FLAGS.workdir[0]) if FLAGS.shortlist else None)
  return create_app(Service(translator, settings))


def _completions_app(FLAGS, slots, programs):
  import jax
  from transformer_jax.decoding import platforms
  from transformer_jax.decoding.completer import Completer
  from transformer_jax.serving import completions, openai_requests
  if FLAGS.int8 or FLAGS.shortlist:
    raise ServeError(f"--{'int8' if FLAGS.int8 else 'shortlist'} is for translation models; "
                     "a language model serves as it was trained")
  completer = Completer(FLAGS.workdir[0], FLAGS.step, ema=FLAGS.ema, command="serve")
  if slots < 0:
    slots = platforms.settings(jax.default_backend()).slots(1)
  limits = openai_requests.Limits(
      max_queue=FLAGS.max_queue, max_request_bytes=FLAGS.max_request_bytes,
      max_sequences=FLAGS.max_sentences, max_prompt_chars=FLAGS.max_sentence_chars,
      read_timeout=FLAGS.read_timeout)
  name = FLAGS.model_name or Path(FLAGS.workdir[0]).absolute().name
  return completions.create_app(
      openai_requests.Service(completer, slots, limits, name, programs))


def run() -> None:
  define_flags()
  app.run(main, flags_parser=launch.flags_parser(__name__))
