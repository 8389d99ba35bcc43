"""The translation server as a real process on localhost, with the trained smoke workdir: real
HTTP requests from concurrent clients, a full queue, bad input, SIGTERM with requests in flight."""

import http.client
import json
import subprocess
import sys
import threading
import time

import portpicker
import pytest

from benchmarks import serve_load
from benchmarks.serve_load import get, metrics, post, start_server, stop_server, wait_ready
from tests.conftest import ROOT
from transformer_jax.decoding.inputs import split_pairs
from transformer_jax.runs.workdir import Workdir


@pytest.fixture(scope="module")
def sources(trained):
  _, workdir = trained
  return [s for s in split_pairs(str(workdir), "validation[:80]")[0] if s.strip()][:48]


@pytest.fixture(scope="module")
def short(trained, sources):
  """Sources of at most 15 tokens: each is one piece (never split into sentences)."""
  _, workdir = trained
  lengths = [len(ids) for ids in Workdir(workdir).tokenizers().src.encode(sources)]
  return [s for s, n in zip(sources, lengths) if n <= 15][:8]


@pytest.fixture(scope="module")
def expected(trained, sources, tmp_path_factory):
  """What `translate` writes for the sources: greedy, with the workdir's beam (4), and with
  beam 4 translating every source whole (as n-best requests are)."""
  _, workdir = trained
  tmp = tmp_path_factory.mktemp("translate")
  (tmp / "src.txt").write_text("".join(s + "\n" for s in sources))
  out = {}
  for name, flags in ((1, ["--beam_size=1"]), (4, ["--beam_size=4"]),
                      ("whole", ["--beam_size=4", "--segment_over=-1"])):
    subprocess.run([sys.executable, "-m", "transformer_jax", "translate", f"--workdir={workdir}",
                    f"--input={tmp / 'src.txt'}", f"--output={tmp / f'{name}.txt'}", *flags],
                   cwd=ROOT, check=True, capture_output=True)
    out[name] = (tmp / f"{name}.txt").read_text().splitlines()
  return out


def _serve(workdir, tmp_path, *flags):
  port = portpicker.pick_unused_port()
  log = open(tmp_path / f"serve_{port}.log", "w")
  server = start_server(str(workdir), port, *flags, log=log)
  try:
    wait_ready(server, port, timeout=600)
  except RuntimeError:
    stop_server(server)
    raise AssertionError((tmp_path / f"serve_{port}.log").read_text()[-3000:])
  return server, port, tmp_path / f"serve_{port}.log"


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
  _, workdir = trained
  server, port, log = _serve(workdir, tmp_path_factory.mktemp("serve"), "--max_sentences=8",
                             "--max_sentence_chars=300", "--max_request_bytes=4000",
                             "--slots=auto")
  yield port
  assert stop_server(server) == 0, log.read_text()[-3000:]


def _connection(port):
  return http.client.HTTPConnection("127.0.0.1", port, timeout=120)


def test_metrics_count_the_requests_and_sentences_the_clients_sent(server, short):
  """benchmarks/serve_load.py's clients (4 at once, 3 requests each) and one bad request
  between its two scrapes of /metrics (read by Prometheus' parser): the server counted what
  the clients sent and were answered."""
  plan = [[[short[(3 * c + r + i) % len(short)] for i in range(1 + r)] for r in range(3)]
          for c in range(4)]
  before = metrics(server)

  def clients():
    run = serve_load.run_clients(server, plan)
    connection = _connection(server)
    assert post(connection, {"sentences": ["x" * 301]})[0] == 400
    connection.close()
    return run

  run, counted = serve_load.scraped(server, clients, serve_load.COUNTED)
  assert run["errors"] == [] and sum(run["counts"].values()) == 12
  # Short sources: one piece each.
  assert counted == {"requests_200": 12, "refused_503": 0,
                     "sentences": sum(len(r) for c in plan for r in c)}
  after = metrics(server)
  moved = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
  endpoint = ("endpoint", "/translate")
  assert moved(("transformer_jax_requests_total", (endpoint, ("status", "400")))) == 1
  assert moved(("transformer_jax_request_seconds_count", (endpoint,))) == 13
  assert after[("transformer_jax_queued_sentences", ())] == 0
  assert {("transformer_jax_shapes_compiled", ()), ("transformer_jax_shapes_planned", ()),
          ("transformer_jax_programs_compiled_total", ())} <= set(after)
  # A scan of random paths adds no series.
  connection = _connection(server)
  connection.request("GET", "/nowhere")
  assert connection.getresponse().status == 404
  connection.close()
  assert ("transformer_jax_requests_total", (("endpoint", "other"), ("status", "404"))) in (
      metrics(server))


def test_concurrent_clients_get_what_translate_gives(server, sources, expected):
  # 8 clients at once, each sending its share of the sources in requests of 1 to 4 sentences,
  # greedy and with beam 4 (the workdir's default) in turn; n-best on some.
  answers, failures = {}, []

  def client(c):
    connection = _connection(server)
    mine = list(range(c, len(sources), 8))
    for r, start in enumerate(range(0, len(mine), 1 + c % 4)):
      indices = mine[start:start + 1 + c % 4]
      request = {"sentences": [sources[i] for i in indices], "id": [c, r]}
      beam = 1 if (c + r) % 2 else 4
      if beam == 1:
        request["beam_size"] = 1
      elif r % 2:
        request["n_best"] = 3
      status, body, _ = post(connection, request)
      if status != 200 or body.get("id") != [c, r]:
        failures.append((status, body))
        continue
      for i, entry in zip(indices, body["translations"]):
        answers[i, beam] = entry
    connection.close()

  threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not failures
  assert {i for i, _ in answers} == set(range(len(sources)))
  for (i, beam), entry in answers.items():
    assert entry["text"] == expected["whole" if "n_best" in entry else beam][i]
    assert entry["score"] < 0
    if "n_best" in entry:
      scores = [h["score"] for h in entry["n_best"]]
      assert len(scores) == 3 and scores == sorted(scores, reverse=True)
      assert entry["n_best"][0]["text"] == entry["text"]
  assert any("n_best" in entry for entry in answers.values())


@pytest.mark.parametrize("body, message", [
    (b'{"sentences": ["I lost."', "not valid JSON"),
    (b'{"sentences": ["I \xff lost."]}', "not UTF-8 text (byte 19)"),
    (b'["I lost."]', "must be a JSON object"),
    (json.dumps({"sentences": ["a"] * 9}).encode(), "9 sentences; the limit is 8 per request"),
    (json.dumps({"sentences": ["a" * 301]}).encode(), "301 characters; the limit is 300"),
    (json.dumps({"sentences": ["x" * 3990]}).encode(), "the limit is 4000 (--max_request_bytes)"),
    (json.dumps({"sentences": ["Tom " * 40], "n_best": 2}).encode(),
     "sentences[0] has 41 tokens with <eos>, over the model's max_len, 32: an n_best request "
     "translates a sentence whole"),
    (json.dumps({"sentences": ["I lost.", " "]}).encode(), "sentences[1] is empty"),
    (json.dumps({"sentences": ["I lost.", 3]}).encode(), "sentences[1] is not a string"),
    (json.dumps({"sentences": []}).encode(), "non-empty list of strings"),
    (json.dumps({"sentences": ["I lost."], "beam_size": 3}).encode(),
     "beam_size 3 is not served; choose one of 1, 4"),
    (json.dumps({"sentences": ["I lost."], "beam_size": 1, "n_best": 2}).encode(),
     "n_best 2 must be from 0 (off) to the beam size (1)"),
    (json.dumps({"sentences": ["I lost."], "alpha": -1}).encode(), "alpha must be a number"),
    (b'{"sentences": ["I lost."], "alpha": NaN}', "alpha must be a number from 0 to 2.0"),
    (b'{"sentences": ["I lost."], "alpha": 1e400}', "alpha must be a number from 0 to 2.0"),
    (b'{"sentences": ["I \\ud800 lost."]}', "sentences[0] holds a lone surrogate"),
    (b"[" * 1900 + b"]" * 1900, "not valid JSON"),
    (json.dumps({"sentences": ["I lost."], "temperature": 1}).encode(),
     "unknown field 'temperature'"),
])
def test_bad_requests_get_400_with_a_message(server, body, message):
  connection = _connection(server)
  status, answer, _ = post(connection, body)
  connection.close()
  assert status == 400
  assert message in answer["error"]


@pytest.mark.parametrize("headers,status,message", [
    ({"Content-Type": "text/plain"}, 415, "the request body must be JSON"),
    ({"Content-Type": "application/json", "Host": "rebound.example"}, 421,
     "this server answers requests to 127.0.0.1, localhost, ::1 only, not to rebound.example"),
])
def test_what_a_browser_page_sends_is_refused_before_it_is_read(server, headers, status,
                                                                message):
  connection = _connection(server)
  connection.request("POST", "/translate", body=json.dumps({"sentences": ["I lost."]}),
                     headers=headers)
  response = connection.getresponse()
  answer = json.loads(response.read())
  connection.close()
  assert response.status == status and message in answer["error"], answer


def test_a_large_request_of_many_lines_does_not_stall_other_clients(trained, tmp_path):
  """64 lines of 90 short sentences each (63 KB): splitting them takes seconds, once done on
  the event loop before any other client was answered; /health now answers meanwhile, and
  the request is then refused for the sentences it makes."""
  import threading
  server, port, log = _serve(trained[1], tmp_path)
  try:
    lines = [" ".join(f"I am {i} here." for i in range(90))[:980] for _ in range(64)]
    body = json.dumps({"sentences": lines}).encode()
    assert 60_000 < len(body) < 65_536
    sent, order, status = threading.Event(), [], {}

    def big():
      connection = _connection(port)
      connection.request("POST", "/translate", body=body,
                         headers={"Content-Type": "application/json"})
      sent.set()
      response = connection.getresponse()
      status["big"] = (response.status, json.loads(response.read()))
      order.append("big")

    thread = threading.Thread(target=big)
    thread.start()
    assert sent.wait(60)
    assert get(port, "/health")[0] == 200
    order.append("health")
    thread.join(120)
    assert order == ["health", "big"], (order, status)
    assert status["big"][0] == 400 and "sentences to decode" in status["big"][1]["error"]
  finally:
    assert stop_server(server) == 0, log.read_text()[-3000:]


def test_a_sentence_over_the_models_length_is_translated_as_translate_does(server, trained,
                                                                          tmp_path):
  """Over max_len tokens: cut to fit and translated in pieces, by `serve` as by `translate`."""
  _, workdir = trained
  long = "Tom said that he would come back, " * 4 + "and then he left."
  (tmp_path / "in.txt").write_text(long + "\n")
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "translate",
                           f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}",
                           "--beam_size=4"], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0 and "have more tokens than the model's 32" in result.stderr
  connection = _connection(server)
  status, answer, _ = post(connection, {"sentences": [long], "beam_size": 4})
  connection.close()
  assert status == 200, answer
  assert answer["translations"][0]["text"] == result.stdout.strip()


def test_health_ready_and_info(server):
  assert get(server, "/health") == (200, {"status": "ok"})
  status, ready = get(server, "/ready")
  assert status == 200 and ready["ready"] and 0 <= ready["shapes_compiled"] <= ready["shapes"]
  assert ready["shapes"] == 4  # Beams 1 and 4, source widths of up to 16 and 32 tokens.
  status, info = get(server, "/info")
  assert status == 200 and info["max_len"] == 32 and info["settings"]["beam_sizes"] == [1, 4]
  assert info["settings"]["slots"] == -1 and info["settings"]["lanes"] == 0
  status, stats = get(server, "/stats")
  assert status == 200 and set(stats) == {"batches", "sentences", "rows", "decode_s"}
  assert stats["rows"] >= stats["sentences"] >= stats["batches"]


def _wait_queued(port, count, timeout=60):
  start = time.monotonic()
  while get(port, "/ready")[1]["queued"] < count:
    assert time.monotonic() - start < timeout, "the requests were not queued"
    time.sleep(0.02)


def _send_in_thread(port, request, results, key):
  def send():
    connection = _connection(port)
    try:
      results[key] = post(connection, request)[:2]
    except (OSError, http.client.HTTPException) as e:  # The server stopped before taking it.
      results[key] = (None, repr(e))
    finally:
      connection.close()
  thread = threading.Thread(target=send)
  thread.start()
  return thread


def test_a_full_queue_refuses_and_loses_nothing_accepted(trained, tmp_path, short, sources,
                                                         expected):
  # One slot of 4 beams a class and a queue of 4: bursts of 8 requests of 4 sentences at once
  # overflow it; a refused request is sent again after its Retry-After until answered.
  _, workdir = trained
  process, port, log = _serve(workdir, tmp_path, "--max_queue=4", "--max_sentences=4",
                              "--slots=1", "--lanes=1")
  refusals, answers, lock = [], [], threading.Lock()

  def client(c):
    connection = _connection(port)
    lines = [short[(c + i) % len(short)] for i in range(4)]
    while True:
      status, body, headers = post(connection, {"sentences": lines})
      if status != 503:
        break
      with lock:
        refusals.append((headers.get("retry-after"), body["error"]))
      time.sleep(0.05)
    connection.close()
    with lock:
      answers.append((lines, status, body))

  try:
    for _ in range(10):  # Until a burst met a full queue.
      threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
      for t in threads:
        t.start()
      for t in threads:
        t.join()
      if refusals:
        break
    assert refusals, "no burst filled the queue"
    assert all(after == "1" and "the queue is full" in error and "--max_queue" in error
               for after, error in refusals)
    assert len(answers) % 8 == 0 and answers
    for lines, status, body in answers:
      assert status == 200
      assert [t["text"] for t in body["translations"]] == [
          expected[4][sources.index(s)] for s in lines]
  finally:
    assert stop_server(process) == 0, log.read_text()[-3000:]


def test_sigterm_answers_the_requests_in_flight_then_exits_0(trained, tmp_path, short, sources,
                                                              expected):
  # One slot of 4 beams a class: 8 requests of 4 sentences wait in the queue for it.
  _, workdir = trained
  process, port, log = _serve(workdir, tmp_path, "--slots=1", "--lanes=1")
  results, threads = {}, []
  requests = [[short[(r + i) % len(short)] for i in range(4)] for r in range(8)]
  for r, lines in enumerate(requests):
    threads.append(_send_in_thread(port, {"sentences": lines}, results, r))
  _wait_queued(port, 28)  # Every request received: one decoding, seven waiting.
  # And one that takes seconds to split into sentences (63 KB of short lines) when the signal
  # comes: before that was done off the event loop, SIGTERM reset every connection here.
  many = [" ".join(f"I am {i} here." for i in range(90))[:980] for _ in range(64)]
  threads.append(_send_in_thread(port, {"sentences": many}, results, "many"))
  time.sleep(0.5)
  assert stop_server(process) == 0  # SIGTERM while they wait.
  for t in threads:
    t.join()
  answered = [r for r, (status, _) in results.items() if status == 200]
  assert len(answered) >= 3
  for r in answered:
    assert [t["text"] for t in results[r][1]["translations"]] == [
        expected[4][sources.index(s)] for s in requests[r]]
  # Every request sent before the signal is answered or refused, never reset.
  assert all(results[r][0] in (200, 503) for r in range(8)), results
  assert results["many"][0] in (400, 503), results["many"]
  assert "every accepted request was answered" in log.read_text()
  with pytest.raises(ConnectionRefusedError):
    get(port, "/health")


@pytest.mark.parametrize("signals", [1, 2])
def test_a_client_stalled_halfway_through_its_request_does_not_hold_up_shutdown(trained,
                                                                                 tmp_path,
                                                                                 signals):
  """SIGTERM while a client has sent half a request body: the server waits --shutdown_timeout
  for it (or not at all after a second signal), then closes the connection and exits 0 with no
  traceback (without the timeout it stayed up, refusing new connections, for as long as the
  client held on)."""
  import socket
  _, workdir = trained
  process, port, log = _serve(workdir, tmp_path, "--shutdown_timeout=5")
  with socket.create_connection(("127.0.0.1", port)) as stalled:
    body = json.dumps({"sentences": ["Hello."]}).encode()
    stalled.sendall(b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
    get(port, "/health")  # The server has read the headers and waits for the rest.
    for _ in range(signals):
      process.send_signal(subprocess.signal.SIGTERM)
      time.sleep(0.5)
    try:
      status = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
      process.kill()
      raise AssertionError("the server did not exit: " + log.read_text()[-3000:])
    assert status == 0, log.read_text()[-3000:]
    stalled.settimeout(30)
    received = b""
    while chunk := stalled.recv(4096):  # Until the server closes the connection.
      received += chunk
    assert received == b"" or received.startswith(b"HTTP/1.1 5"), received
  assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.mark.parametrize("flags, message", [
    (["--shutdown_timeout=0"], "--shutdown_timeout must be positive (seconds), got 0.0"),
    (["--max_queue=4", "--max_sentences=8"], "--max_queue 4 is below --max_sentences 8"),
    (["--beam_sizes=1"], "leaves out the workdir's default beam size (4)"),
    (["--beam_sizes=0,4"], "--beam_sizes must be at least 1"),
    (["--slots=0"], "--slots must be 'auto' or a count of at least 1, got '0'"),
    (["--slots=auto", "--lanes=-1"], "--lanes must be 0 (the device's) or positive, got -1"),
])
def test_bad_flags_are_one_line_errors(trained, flags, message):
  _, workdir = trained
  port = portpicker.pick_unused_port()
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "serve",
                           f"--workdir={workdir}", f"--port={port}", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith("error: ")
  assert message in result.stderr


def test_a_port_in_use_is_a_one_line_error(trained):
  _, workdir = trained
  import socket
  with socket.create_server(("127.0.0.1", 0)) as taken:
    port = taken.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "transformer_jax", "serve",
                             f"--workdir={workdir}", f"--port={port}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert f"error: cannot listen on 127.0.0.1:{port}" in result.stderr


def test_host_names_are_case_insensitive_and_http_1_0_needs_no_host(server):
  """`Host: LOCALHOST` is localhost (421 once); an HTTP/1.0 request has no Host header to
  send (421 once, for a client that cannot name one)."""
  import socket
  connection = _connection(server)
  connection.request("GET", "/health", headers={"Host": f"LOCALHOST:{server}"})
  response = connection.getresponse()
  response.read()
  connection.close()
  assert response.status == 200
  with socket.create_connection(("127.0.0.1", server), timeout=60) as raw:
    raw.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    answer = b""
    while chunk := raw.recv(65536):
      answer += chunk
  assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"200", answer[:300]
