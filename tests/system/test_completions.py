"""The language-model server as a real process on localhost, with the shared smoke language
model, through the official `openai` client: every field, streams, seeds under concurrent load,
greedy equal to `generate`, OpenAI's error shape, a client that leaves mid-stream, SIGTERM with
streams open."""

import concurrent.futures
import http.client
import json
import subprocess
import sys
import time

import openai
import portpicker
import pytest

from benchmarks import completions_load, serve_load
from benchmarks.serve_load import get, metrics, start_server, stop_server, wait_ready
from tests.conftest import ROOT

PROMPTS = ["ROMEO.", "To be, or not", "JULIET.\nO"]
MODEL = "lm_run"  # The workdir's folder name.
JSON = {"Content-Type": "application/json"}


def _serve(workdir, tmp_path, *flags):
  port = portpicker.pick_unused_port()
  log_path = tmp_path / f"serve_{port}.log"
  server = start_server(str(workdir), port, *flags, log=open(log_path, "w"))
  try:
    wait_ready(server, port, timeout=600)
  except RuntimeError:
    stop_server(server)
    raise AssertionError(log_path.read_text()[-3000:])
  return server, port, log_path


@pytest.fixture(scope="module")
def server(lm_run, tmp_path_factory):
  server, port, log = _serve(lm_run, tmp_path_factory.mktemp("serve_lm"), "--slots=4",
                             "--max_sentences=12", "--read_timeout=3")
  yield port
  assert stop_server(server) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused",
                       max_retries=0)


def _generate(lm_run, tmp_path, *flags):
  """`generate`'s continuations of PROMPTS with `flags`."""
  prompts, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
  prompts.write_text("".join(p.replace("\n", "\\n") + "\n" for p in PROMPTS))
  proc = subprocess.run([sys.executable, "-m", "transformer_jax", "generate", "--workdir",
                         str(lm_run), "--input", str(prompts), "--output", str(out), *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


def test_greedy_and_seeded_completions_are_what_generate_writes(lm_run, client, tmp_path):
  """Greedy (temperature 0) and sampling with a seed: each prompt of a list continues as
  `generate` continues it (a seed draws with the key of the prompt's number in either)."""
  greedy = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0)
  assert [c.text for c in greedy.choices] == _generate(lm_run, tmp_path, "--max_new_tokens=10")
  assert [c.index for c in greedy.choices] == [0, 1, 2]
  assert {c.finish_reason for c in greedy.choices} <= {"length", "stop"}
  sampled = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10,
                                      temperature=0.9, top_p=0.9, seed=3,
                                      extra_body={"top_k": 50})
  assert [c.text for c in sampled.choices] == _generate(
      lm_run, tmp_path, "--max_new_tokens=10", "--temperature=0.9", "--top_p=0.9",
      "--top_k=50", "--seed=3")


def test_generate_and_the_server_end_where_the_model_does(lm_run, client, tmp_path):
  """One rule in both: a row holds max_len tokens, <bos> and the prompt included. `generate`
  asked for more writes what the server gives at the most max_tokens it allows; one more is
  refused."""
  from transformer_jax.decoding.completer import Completer
  completer = Completer(lm_run)
  ends = _generate(lm_run, tmp_path, f"--max_new_tokens={completer.max_len}")
  for prompt, ids, end in zip(PROMPTS, completer.tokenizer.encode(PROMPTS), ends):
    room = completer.max_len - 1 - len(ids)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=room,
                                       temperature=0)
    assert answer.choices[0].text == end, prompt
    with pytest.raises(openai.BadRequestError) as e:
      client.completions.create(model=MODEL, prompt=prompt, max_tokens=room + 1, temperature=0)
    assert e.value.body["code"] == "context_length_exceeded"


def test_a_top_p_below_float32s_normal_range_is_the_greedy_text(client):
  args = dict(model=MODEL, prompt=PROMPTS, max_tokens=10)
  greedy = client.completions.create(**args, temperature=0)
  tiny = client.completions.create(**args, temperature=1.0, top_p=1e-40, seed=1)
  assert [c.text for c in tiny.choices] == [c.text for c in greedy.choices]
  assert all(c.text for c in tiny.choices)


def test_logprobs_end_at_a_stop_string_and_count_characters(client):
  """The tokens (and completion_tokens) end with the one a stop string begins in; a byte
  piece reads as OpenAI shows one ("bytes:\\xc3"), and every text_offset lies in the text."""
  args = dict(model=MODEL, prompt="ROMEO.", max_tokens=12, temperature=1.0, seed=3,
              logprobs=1)
  whole = client.completions.create(**args).choices[0]
  # A stop string whose first occurrence is past the text's start.
  cut = next(i for i in range(2, len(whole.text) - 1)
             if whole.text.find(whole.text[i:i + 2]) == i)
  r = client.completions.create(**args, stop=[whole.text[cut:cut + 2]])
  c = r.choices[0]
  assert c.text == whole.text[:cut] and c.finish_reason == "stop"
  offsets, all_offsets = c.logprobs.text_offset, whole.logprobs.text_offset
  assert r.usage.completion_tokens == len(c.logprobs.tokens) == len(offsets) >= 1
  assert c.logprobs.tokens == whole.logprobs.tokens[:len(offsets)]
  assert offsets == all_offsets[:len(offsets)]
  # The last token begins before the stop string; the next one would not.
  assert offsets[-1] < cut <= (all_offsets + [len(whole.text)])[len(offsets)]
  echo = client.completions.create(model=MODEL, prompt="Ét\u00e9 \u2603", max_tokens=1,
                                   temperature=0, logprobs=1, echo=True).choices[0]
  pieces = echo.logprobs.tokens
  assert any(t.startswith("bytes:\\x") for t in pieces), pieces
  assert not any(t.startswith("<0x") for t in pieces)
  assert echo.logprobs.text_offset == sorted(echo.logprobs.text_offset)
  assert all(o <= len(echo.text) for o in echo.logprobs.text_offset), (echo.text, echo.logprobs)


def test_n_echo_logprobs_and_usage(client, lm_run):
  from transformer_jax.runs.workdir import Workdir
  tokenizer = Workdir(lm_run).tokenizers().tgt
  r = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=6, temperature=1.0,
                                n=3, seed=5, logprobs=2, echo=True)
  assert [c.index for c in r.choices] == [0, 1, 2]
  prompt_tokens = len(tokenizer.encode(["ROMEO."])[0])
  assert r.usage.prompt_tokens == prompt_tokens
  for c in r.choices:
    assert c.text.startswith("ROMEO.")
    lp = c.logprobs
    new = len(lp.tokens) - prompt_tokens  # Echo: the prompt's tokens come first.
    assert 1 <= new <= 6 and (new == 6) == (c.finish_reason == "length")
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
  assert r.usage.completion_tokens == sum(
      len(c.logprobs.tokens) - prompt_tokens for c in r.choices)
  assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
  texts = {c.text for c in r.choices}
  assert len(texts) > 1  # Three draws of one seed differ: each choice has its own key.
  again = client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=6,
                                    temperature=1.0, n=3, seed=5)
  assert [c.text for c in again.choices] == [c.text[len("ROMEO."):] for c in r.choices]


def test_a_stream_read_by_the_clients_iterator_is_the_answer_in_pieces(client):
  args = dict(model=MODEL, prompt="To be, or not", max_tokens=20, temperature=0.8, seed=11)
  whole = client.completions.create(**args).choices[0]
  chunks = list(client.completions.create(**args, stream=True,
                                          stream_options={"include_usage": True}))
  pieces = [c for c in chunks if c.choices]
  assert len(pieces) > 1 and "".join(c.choices[0].text for c in pieces) == whole.text
  assert [c.choices[0].finish_reason for c in pieces] == [None] * (len(pieces) - 1) + [
      whole.finish_reason]
  assert chunks[-1].usage is not None and not chunks[-1].choices
  assert chunks[-1].usage.completion_tokens >= 1


def test_stop_strings_end_the_text_before_them(client):
  # The first seed whose text runs past 8 characters (the smoke model's weights, and so its
  # texts, differ between CPUs: on some it ends seed 2's at once).
  for seed in range(2, 12):
    args = dict(model=MODEL, prompt="JULIET.\nO", max_tokens=20, temperature=0.7, seed=seed)
    text = client.completions.create(**args).choices[0].text
    if len(text) >= 8:
      break
  stop = text[6:8]  # Some text it writes: it must end before its first occurrence.
  assert len(stop) == 2, text
  cut = client.completions.create(**args, stop=[stop, "\u00a7never\u00a7"]).choices[0]
  assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"
  streamed = list(client.completions.create(**args, stop=stop, stream=True))
  assert "".join(c.choices[0].text for c in streamed) == cut.text
  assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_seed_gives_the_same_text_under_concurrent_load(client):
  """One request with seed 7, alone and then among 11 others with other prompts and settings
  running in the same slots: the same text."""
  ask = dict(model=MODEL, prompt="ROMEO.", max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
  alone = client.completions.create(**ask).choices[0].text
  others = [dict(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=4 + i, temperature=0.5 + i / 10,
                 seed=i, n=1 + i % 2) for i in range(11)]
  with concurrent.futures.ThreadPoolExecutor(12) as pool:
    futures = [pool.submit(client.completions.create, **o) for o in others[:6]]
    mine = pool.submit(client.completions.create, **ask)
    futures += [pool.submit(client.completions.create, **o) for o in others[6:]]
    assert mine.result().choices[0].text == alone
    assert all(len(f.result().choices) == o["n"] for f, o in zip(futures, others))


@pytest.mark.parametrize("body, status, param, message", [
    (b'{"model": "lm_run", "prompt": ', 400, None, "the request body is not valid JSON"),
    (b'{"model": "lm_run", "prompt": "ROMEO.", "max_tokens": ' + b"9" * 5000 + b"}", 400, None,
     "a number in the request body has 5,000 digits; no field takes more than 100"),
    ({"model": "lm_run", "prompt": "word " * 60}, 400, "prompt",
     r"prompt 0 has \d+ tokens and max_tokens is 16: the model holds 32 positions"),
    ({"model": "lm_run", "prompt": "ROMEO.", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens must be an integer from 1 to 32, got 0"),
    ({"model": "lm_run", "prompt": "ROMEO.", "max_tokens": 10 ** 6}, 400, "max_tokens",
     "max_tokens must be an integer from 1 to 32"),
    ({"model": "lm_run", "prompt": "ROMEO.", "max_tokens": 30}, 400, "max_tokens",
     r"prompt 0 has \d+ tokens and max_tokens is 30: .* so at most \d+ new tokens fit"),
    ({"model": "lm_run", "prompt": "ROMEO.", "n": 0}, 400, "n",
     "n must be an integer from 1 to 12, got 0"),
    ({"model": "lm_run", "prompt": ["a", "b", "c"], "n": 5}, 400, "n",
     r"3 prompts x n=5 make 15 sequences; the limit is 12 per request \(--max_sentences\)"),
    ({"model": "lm_run", "prompt": "ROMEO.", "colour": "red"}, 400, "colour",
     "unknown field 'colour'"),
    ({"model": "lm_run", "prompt": "ROMEO.", "best_of": 3}, 400, "best_of",
     r"best_of is not supported by this server \(only 1\)"),
    ({"model": "lm_run", "prompt": "ROMEO.", "temperature": -1}, 400, "temperature",
     "temperature must be a number from 0.0 to 2.0, got -1"),
    ({"model": "lm_run", "prompt": "ROMEO.", "top_k": 100000}, 400, "top_k",
     r"top_k must be an integer from 0 to \d+, got 100000"),
    ({"model": "lm_run", "prompt": "ROMEO.", "logprobs": 6}, 400, "logprobs",
     "logprobs must be an integer from 0 to 5, got 6"),
    ({"model": "lm_run", "prompt": "ROMEO.", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "stop must be a string or a list of at most 4 non-empty strings"),
    ({"model": "lm_run", "prompt": "ROMEO.", "stop": ["ab", "x" * 401]}, 400, "stop",
     "a stop string has 401 characters; the limit is 400"),
    ({"model": "lm_run", "prompt": 7}, 400, "prompt", "prompt must be a string or a non-empty"),
    ({"model": "gpt-4", "prompt": "ROMEO."}, 404, "model", "the model 'gpt-4' is not served"),
])
def test_bad_requests_get_openais_error_shape(server, body, status, param, message):
  import re
  connection = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  connection.request("POST", "/v1/completions", body=data, headers=JSON)
  response = connection.getresponse()
  error = json.loads(response.read())["error"]
  assert response.status == status, error
  assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
  assert re.search(message, error["message"]), error["message"]


@pytest.mark.parametrize("method,path,headers,status,code", [
    # A web page's form or fetch() of text: refused before anything is decoded.
    ("POST", "/v1/completions", {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ("POST", "/v1/completions", {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    ("POST", "/v1/completions", {}, 415, "unsupported_media_type"),
    # A name a page resolved to 127.0.0.1 (DNS rebinding).
    ("POST", "/v1/completions", {**JSON, "Host": "evil.example:8080"}, 421,
     "misdirected_request"),
    ("POST", "/v1/chat/completions", JSON, 404, "not_found"),
    ("GET", "/v1/completions", {}, 405, "method_not_allowed"),
])
def test_what_a_browser_page_or_a_wrong_path_sends_is_refused_in_openais_shape(
    server, method, path, headers, status, code):
  connection = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
  connection.request(method, path, headers=headers, body=json.dumps(
      {"model": MODEL, "prompt": "ROMEO.", "max_tokens": 2}) if method == "POST" else None)
  response = connection.getresponse()
  error = json.loads(response.read())["error"]
  assert (response.status, error["code"]) == (status, code), error
  assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_a_client_that_leaves_before_its_whole_answer_has_nothing_more_decoded(server):
  """A non-streaming request of n=12 dropped as soon as its first sequence starts: those
  running end, those still queued never start (4 slots: 4 of the 12 run, a few more where
  the first end before the server hears the client go)."""
  import socket
  before = get(server, "/stats")[1]
  body = json.dumps({"model": MODEL, "prompt": "ROMEO.", "n": 12, "max_tokens": 24,
                     "temperature": 1.0}).encode()
  with socket.create_connection(("127.0.0.1", server)) as sock:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while get(server, "/stats")[1]["sequences"] == before["sequences"]:
      assert time.monotonic() < deadline
  deadline = time.monotonic() + 120
  while (after := get(server, "/stats")[1])["running"] or after["queued"]:
    assert time.monotonic() < deadline, after
  assert 1 <= after["sequences"] - before["sequences"] <= 8, (before, after)


def test_slow_or_greedy_clients_cannot_hold_the_server(server):
  """A head sent a line a second is cut off at --read_timeout (3 s here), a body likewise
  (400); a head over 16 KB is refused at once; meanwhile other clients are answered."""
  import socket
  began = time.monotonic()
  with socket.create_connection(("127.0.0.1", server)) as slow:
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed = False
    for i in range(30):
      try:
        slow.sendall(b"X-Slow-%d: 1\r\n" % i)
        slow.settimeout(1.0)
        closed = slow.recv(100) == b""
      except socket.timeout:
        continue
      except ConnectionError:
        closed = True
      if closed:
        break
    assert closed and time.monotonic() - began < 10
  with socket.create_connection(("127.0.0.1", server)) as greedy:
    greedy.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 40000)
    greedy.settimeout(30)
    assert greedy.recv(100).startswith(b"HTTP/1.1 400")
  connection = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
  connection.putrequest("POST", "/v1/completions")
  for name, value in (*JSON.items(), ("Content-Length", "100")):
    connection.putheader(name, value)
  connection.endheaders(b'{"model": ')  # And no more.
  response = connection.getresponse()
  error = json.loads(response.read())["error"]
  assert response.status == 400 and "did not arrive within 3 s" in error["message"], error
  assert get(server, "/health")[0] == 200


def test_an_api_key_is_checked_as_openais_clients_send_it(lm_run, tmp_path):
  process, port, log = _serve(lm_run, tmp_path, "--slots=2", "--api_key=s3cret")
  try:
    assert get(port, "/health")[0] == 200  # Probes need no key.
    for key in ("wrong", "s3cret2"):
      bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
      with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=2)
      assert e.value.body["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret",
                         max_retries=0)
    assert good.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=2).choices
    assert get(port, "/stats")[0] == 401
    with pytest.raises(RuntimeError, match="answered 401"):
      metrics(port)
    # The guard's refusals are counted where the answers are.
    counted = metrics(port, api_key="s3cret")
    status = lambda endpoint, code: counted.get(  # noqa: E731
        ("transformer_jax_requests_total", (("endpoint", endpoint), ("status", code))))
    assert (status("/v1/completions", "401"), status("/v1/completions", "200"),
            status("/stats", "401"), status("/metrics", "401")) == (2, 1, 1, 1)
  finally:
    assert stop_server(process) == 0, log.read_text()[-3000:]


def test_the_client_raises_openais_errors(client):
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=0)
  assert e.value.body["param"] == "max_tokens"
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model="other", prompt="ROMEO.")
  models = client.models.list()
  assert [m.id for m in models.data] == [MODEL]


def _open_stream(port, body):
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  connection.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                     headers=JSON)
  response = connection.getresponse()
  assert response.status == 200
  return connection, response


def _events(response):
  """The data lines of a server-sent event stream, to its [DONE] (or the connection's end)."""
  while line := response.fp.readline():
    if line.startswith(b"data: "):
      yield line[6:].strip().decode()
      if line.strip() == b"data: [DONE]":
        return


def test_a_client_that_leaves_mid_stream_frees_its_slots(lm_run, tmp_path):
  """48 sequences on one slot: while they wait, a request that would overflow the queue gets
  503; the client reads one piece and hangs up; those still queued never start, the slot
  frees, and the next request is answered."""
  process, port, log = _serve(lm_run, tmp_path, "--slots=1", "--max_sentences=48",
                              "--max_queue=60")
  try:
    connection, response = _open_stream(port, {"model": MODEL, "prompt": "ROMEO.", "n": 48,
                                               "max_tokens": 24, "temperature": 1.0})
    next(_events(response))
    other = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    other.request("POST", "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": "ROMEO.", "n": 20, "max_tokens": 4}), headers=JSON)
    full = other.getresponse()
    error = json.loads(full.read())["error"]
    assert full.status == 503 and full.getheader("Retry-After") == "1", error
    assert error["code"] == "queue_full" and "the queue is full" in error["message"]
    connection.sock.shutdown(2)
    connection.close()
    deadline = time.monotonic() + 60
    while (stats := get(port, "/stats")[1])["running"] or stats["queued"]:
      assert time.monotonic() < deadline, stats
      time.sleep(0.2)
    assert stats["sequences"] < 48, stats  # Those still queued were dropped.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="ROMEO.", max_tokens=3).choices
  finally:
    assert stop_server(process) == 0, log.read_text()[-3000:]


def test_sigterm_with_streams_open_ends_each_then_exits_0(lm_run, tmp_path):
  """Three streams on one slot (two wait for it): SIGTERM once the first has a piece; each
  stream still gets its whole text and [DONE], and the server exits 0."""
  process, port, log = _serve(lm_run, tmp_path, "--slots=1")
  body = {"model": MODEL, "prompt": "ROMEO.", "max_tokens": 20, "temperature": 0}
  streams = [_open_stream(port, body) for _ in range(3)]
  events = [_events(response) for _, response in streams]
  first = [next(events[0])]
  process.send_signal(15)
  texts = []
  for i, stream in enumerate(events):
    got = (first if i == 0 else []) + list(stream)
    assert got[-1] == "[DONE]", got
    chunks = [json.loads(e) for e in got[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    texts.append("".join(c["choices"][0]["text"] for c in chunks))
  assert texts[0] == texts[1] == texts[2] and texts[0]
  assert process.wait(120) == 0, log.read_text()[-3000:]


def test_when_the_shutdown_time_runs_out_every_request_is_answered_or_refused(lm_run,
                                                                              tmp_path):
  """One slot, 16 requests of n=48 and two streams queued, SIGTERM with --shutdown_timeout 2:
  each request gets its whole answer or OpenAI's 503 with Retry-After (never a bare 500),
  each stream ends with [DONE] (an error event before it where it was cut), and the server
  exits 0."""
  import threading
  process, port, log = _serve(lm_run, tmp_path, "--slots=1", "--max_queue=1024",
                              "--shutdown_timeout=2")
  body = {"model": MODEL, "prompt": "ROMEO.", "max_tokens": 24, "temperature": 1.0, "n": 48}
  answers = []

  def ask(seed):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/v1/completions", body=json.dumps({**body, "seed": seed}),
                       headers=JSON)
    response = connection.getresponse()
    answers.append((response.status, response.getheader("Retry-After"),
                    json.loads(response.read())))

  threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(16)]
  for thread in threads:
    thread.start()
  streams = [_open_stream(port, {**body, "n": 1, "seed": 99 + i}) for i in range(2)]
  deadline = time.monotonic() + 60
  while get(port, "/stats")[1]["queued"] < 100:
    assert time.monotonic() < deadline
  process.send_signal(15)
  for thread in threads:
    thread.join(120)
  statuses = sorted(status for status, _, _ in answers)
  assert len(answers) == 16 and set(statuses) <= {200, 503} and 503 in statuses, statuses
  for status, retry, answer in answers:
    if status == 503:
      assert retry == "1" and answer["error"]["code"] == "shutting_down", answer
    else:
      assert len(answer["choices"]) == 48
  for _, response in streams:
    got = list(_events(response))
    assert got[-1] == "[DONE]", got
  assert process.wait(120) == 0, log.read_text()[-3000:]


def test_metrics_count_the_requests_and_tokens_the_clients_saw(server, client):
  """Streaming and whole requests at once, then /metrics: its request and token counts moved
  by what the clients counted (usage), and each stream's first event was timed."""
  before = metrics(server)
  asks = [dict(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=8 + i, temperature=1.0, seed=i,
               n=1 + i % 2, stream=i % 2 == 0) for i in range(8)]

  def tokens(ask) -> int:
    if not ask["stream"]:
      return client.completions.create(**ask).usage.completion_tokens
    chunks = list(client.completions.create(**ask, stream_options={"include_usage": True}))
    return chunks[-1].usage.completion_tokens

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    counted = sum(pool.map(tokens, asks))
  after = metrics(server)
  moved = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
  ok = (("endpoint", "/v1/completions"), ("status", "200"))
  assert moved(("transformer_jax_requests_total", ok)) == len(asks)
  assert moved(("transformer_jax_completion_tokens_total", ())) == counted
  assert moved(("transformer_jax_sequences_total", ())) == sum(a["n"] for a in asks)
  stream = (("endpoint", "/v1/completions"),)
  assert moved(("transformer_jax_first_event_seconds_count", stream)) == 4
  assert moved(("transformer_jax_request_seconds_count", stream)) == len(asks)
  assert after[("transformer_jax_running_sequences", ())] == 0
  assert (after[("transformer_jax_programs_compiled_total", ())]
          + after[("transformer_jax_programs_loaded_total", ())]) >= 1
  # benchmarks/completions_load.py's clients, between its two scrapes.
  bodies = [dict(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=6 + i, temperature=1.0, seed=i)
            for i in range(4)]
  run, counted = serve_load.scraped(
      server, lambda: completions_load.run_mode(server, [[body] for body in bodies]),
      completions_load.COUNTED)
  assert run["errors"] == [] and len(run["results"]) == 4
  assert counted == {"requests_200": 4, "first_events": 4,
                     "completion_tokens": sum(r[2] for r in run["results"].values())}


def test_an_ending_eos_is_not_a_new_token_in_the_servers_count():
  """The engine counts a sequence's new tokens as usage does: its <eos> is not one (the
  metrics test above sees this only where the model ends a choice within max_tokens)."""
  import numpy as np
  from transformer_jax.data.tokenizer import EOS
  from transformer_jax.serving.lm_engine import Engine, Sequence
  told = []
  loop = type("Loop", (), {"call_soon_threadsafe": lambda self, put, news: put(news)})()
  events = type("Events", (), {"put_nowait": lambda self, news: told.append(news)})()
  engine = Engine.__new__(Engine)
  engine._told = {0: 1}  # Position 0 is <bos>.
  sequence = Sequence(0, [1, 7, 8], 10, None, False, events, loop)  # <bos> and two prompt ids.
  view = {"t": np.array([5]), "done": np.array([True]),
          "tokens": np.array([[1, 7, 8, 21, 22, EOS, 0, 0]])}
  assert engine._tell(0, sequence, view) == (5, 2)  # Positions 1-5; 21 and 22 are new.
  assert told == [(0, [(t, 0.0, [], []) for t in (7, 8, 21, 22, EOS)], "stop")]
  engine._told = {0: 1}
  view["done"] = np.array([False])  # Without <eos>: still running, all three new.
  view["tokens"][0, 5] = 23
  assert engine._tell(0, sequence, view) == (5, 3)
