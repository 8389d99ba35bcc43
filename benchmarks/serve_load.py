"""Load test of the translation server on localhost: concurrent clients, throughput, latency.

  python benchmarks/serve_load.py --workdir runs/fra_eng --clients 16 --requests 20 \
      --json serve_load.json

For each mode it starts `python -m transformer_jax serve` on a free port, waits for /ready (the
start-up compilation, timed), then runs `--clients` threads, each sending `--requests` requests
of 1 to `--max_sentences` validation sources (the workdir's own split, the same requests in
every mode) over one keep-alive connection, and stops the server with SIGTERM (its exit status
is checked). Modes:
  default        the server as it ships (decoding slots that sentences enter as they come)
  one_at_a_time  the same server with one client sending every client's requests in turn
                 (one request at a time)
  full_queue     `serve --max_queue Q` (a small Q): requests refused with 503 are sent again
                 after their Retry-After (scaled down by --retry_scale); every answer is checked
Every answer is compared with the first mode's answer to the same sentence: the table
counts answers lost (never given), duplicated (given twice) and different. Sentences/s counts
the answered sentences over the wall time of the clients; the server's GET /stats gives the
batches it decoded (sentences a batch, padded rows). GET /metrics, scraped before and after
each mode's clients and read by Prometheus' parser, gives the requests and sentences the server
counted, checked against the clients' counts (`server_counts_agree`).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_model  # noqa: E402


def post(connection: http.client.HTTPConnection, body: dict | bytes,
         path: str = "/translate") -> tuple[int, dict, dict]:
  """(status, JSON body, headers) of one POST on a kept-alive connection."""
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
  response = connection.getresponse()
  return response.status, json.loads(response.read() or b"{}"), dict(response.getheaders())


def metrics(port: int, api_key: str | None = None) -> dict[tuple[str, tuple], float]:
  """GET /metrics, read by Prometheus' own parser: {(sample name, sorted labels): value}."""
  from prometheus_client.parser import text_string_to_metric_families
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    connection.request("GET", "/metrics",
                       headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    response = connection.getresponse()
    text = response.read().decode()
  finally:
    connection.close()
  if response.status != 200 or not response.getheader("Content-Type", "").startswith("text/plain"):
    raise RuntimeError(f"GET /metrics answered {response.status}: {text[:200]}")
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
  """How far a sample of two `metrics()` scrapes moved between them."""
  key = (name, tuple(sorted(labels.items())))
  return after.get(key, 0.0) - before.get(key, 0.0)


def scraped(port: int, run, samples: dict[str, tuple[str, dict]]) -> tuple[object, dict]:
  """`run()` (a mode's clients) between two scrapes of GET /metrics: (what run() returned,
  {key: how far the sample (name, labels) of `samples[key]` moved meanwhile})."""
  before = metrics(port)
  result = run()
  after = metrics(port)
  return result, {key: moved(before, after, name, **labels)
                  for key, (name, labels) in samples.items()}


# What the translation server counts of a mode's clients.
COUNTED = {"requests_200": ("transformer_jax_requests_total",
                            {"endpoint": "/translate", "status": "200"}),
           "refused_503": ("transformer_jax_requests_total",
                           {"endpoint": "/translate", "status": "503"}),
           "sentences": ("transformer_jax_sentences_decoded_total", {})}


def get(port: int, path: str) -> tuple[int, dict]:
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, json.loads(response.read())
  finally:
    connection.close()


def start_server(workdir: str, port: int, *flags: str, log=None, cwd=ROOT) -> subprocess.Popen:
  """`python -m transformer_jax serve` in a subprocess (stdout and stderr to `log`)."""
  command = [sys.executable, "-m", "transformer_jax", "serve", f"--workdir={workdir}",
             f"--port={port}", *flags]
  return subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_ready(server: subprocess.Popen, port: int, timeout: float = 900) -> float:
  """Seconds until GET /ready answers 200; raises if the server exits or the time runs out."""
  start = time.monotonic()
  while time.monotonic() - start < timeout:
    if server.poll() is not None:
      raise RuntimeError(f"the server exited with status {server.returncode} before it was ready")
    try:
      if get(port, "/ready")[0] == 200:
        return time.monotonic() - start
    except (ConnectionError, OSError):
      pass
    time.sleep(0.2)
  raise RuntimeError(f"the server was not ready within {timeout} s")


def stop_server(server: subprocess.Popen, timeout: float = 120) -> int:
  """SIGTERM, then the exit status."""
  server.send_signal(signal.SIGTERM)
  return server.wait(timeout)


def requests_for(sources: list[str], clients: int, per_client: int, max_sentences: int,
                 seed: int = 0) -> list[list[list[str]]]:
  """Each client's requests: lists of 1 to max_sentences sources, drawn without replacement
  while the sources last."""
  rng = random.Random(seed)
  pool = list(sources)
  rng.shuffle(pool)
  out, at = [], 0
  for _ in range(clients):
    mine = []
    for _ in range(per_client):
      n = rng.randint(1, max_sentences)
      mine.append([pool[(at + i) % len(pool)] for i in range(n)])
      at += n
    out.append(mine)
  return out


def run_clients(port: int, plan: list[list[list[str]]], retry_scale: float = 1.0,
                deadline: float = 600, options: dict | None = None) -> dict:
  """Sends every client's requests from its own thread. Returns the answers ({(client, request):
  [translations]}), answer counts, latencies of answered requests, refusals and wall time."""
  answers, counts, latencies, refused, errors = {}, collections.Counter(), [], [0], []
  lock = threading.Lock()
  stop_at = time.monotonic() + deadline

  def client(c: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=deadline)
    try:
      for r, sentences in enumerate(plan[c]):
        while time.monotonic() < stop_at:
          start = time.monotonic()
          status, body, headers = post(connection, {"sentences": sentences, "id": [c, r],
                                                    **(options or {})})
          if status == 503:
            with lock:
              refused[0] += 1
            time.sleep(float(headers.get("retry-after", 1)) * retry_scale)
            continue
          with lock:
            if status != 200:
              errors.append((c, r, status, body))
            else:
              latencies.append(time.monotonic() - start)
              key = tuple(body["id"])
              counts[key] += 1
              answers[key] = [t["text"] for t in body["translations"]]
          break
    except Exception as e:  # noqa: BLE001 -- reported in the result, not a crash of the run.
      with lock:
        errors.append((c, None, type(e).__name__, str(e)))
    finally:
      connection.close()

  start = time.monotonic()
  threads = [threading.Thread(target=client, args=(c,)) for c in range(len(plan))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return {"answers": answers, "counts": counts, "latencies": latencies, "refused": refused[0],
          "errors": errors, "wall": time.monotonic() - start}


def one_client(port: int, plan: list[list[list[str]]], retry_scale: float = 1.0,
               deadline: float = 600, options: dict | None = None) -> dict:
  """run_clients with every client's requests sent in turn by one client (one request at a
  time); the answers keyed by their (client, request) in `plan` all the same."""
  keys = [(c, r) for c in range(len(plan)) for r in range(len(plan[c]))]
  run = run_clients(port, [[plan[c][r] for c, r in keys]], retry_scale, deadline, options)
  run["answers"] = {keys[r]: answer for (_, r), answer in run["answers"].items()}
  run["counts"] = collections.Counter({keys[r]: n for (_, r), n in run["counts"].items()})
  return run


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--split", default="validation", help="The workdir dataset's split the "
                      "sentences come from.")
  parser.add_argument("--clients", type=int, default=16)
  parser.add_argument("--requests", type=int, default=20, help="Requests per client.")
  parser.add_argument("--max_sentences", type=int, default=8, help="Sentences per request: "
                      "1 to this many.")
  parser.add_argument("--beam_size", type=int, default=None, help="Every request's beam_size; "
                      "default: none given (the workdir's decode.beam_size).")
  parser.add_argument("--modes", default="default,one_at_a_time,full_queue")  # See the modes above.
  parser.add_argument("--full_queue", type=int, default=16, help="--max_queue of the "
                      "full_queue mode, in sentences.")
  parser.add_argument("--retry_scale", type=float, default=0.05, help="A refused client waits "
                      "Retry-After x this before sending again.")
  parser.add_argument("--server_flags", default="", help="More serve flags, space-separated.")
  parser.add_argument("--deadline", type=float, default=600, help="Seconds a mode's clients "
                      "may run at most.")
  parser.add_argument("--logs", default=None, help="A directory for the servers' logs.")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  if args.max_sentences > args.full_queue:
    parser.error("--max_sentences must be at most --full_queue: a request must fit the queue")

  import portpicker  # noqa: PLC0415 -- test dependency, imported when run.

  from transformer_jax.decoding.inputs import split_pairs  # noqa: PLC0415
  sources = [s for s in split_pairs(args.workdir, args.split)[0] if s.strip()]
  plan = requests_for(sources, args.clients, args.requests, args.max_sentences)
  sent = sum(len(r) for c in plan for r in c)
  flags = {"default": [], "one_at_a_time": [],
           "full_queue": [f"--max_queue={args.full_queue}",
                          f"--max_sentences={min(args.full_queue, 64)}"]}
  results, reference = {}, None
  for mode in args.modes.split(","):
    port = portpicker.pick_unused_port()
    if args.logs:
      Path(args.logs).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.logs) / f"serve_{mode}.log", "w") if args.logs else subprocess.DEVNULL
    server = start_server(args.workdir, port, *flags[mode], *args.server_flags.split(), log=log)
    try:
      ready_s = wait_ready(server, port)
      options = {} if args.beam_size is None else {"beam_size": args.beam_size}
      clients = one_client if mode == "one_at_a_time" else run_clients
      run, counted = scraped(
          port, lambda: clients(port, plan, args.retry_scale, args.deadline, options), COUNTED)
      stats = get(port, "/stats")[1]
    finally:
      status = stop_server(server)
    if reference is None:
      reference = run["answers"]
    expected = {(c, r) for c in range(len(plan)) for r in range(len(plan[c]))}
    answered = sum(len(plan[c][r]) for c, r in run["answers"])
    row = {
        "mode": mode, "ready_s": round(ready_s, 1), "clients": args.clients,
        "beam_size": args.beam_size, "sentences_per_request": [1, args.max_sentences],
        "requests": len(expected), "sentences": sent, "answered_sentences": answered,
        "wall_s": round(run["wall"], 2), "sentences_per_s": round(answered / run["wall"], 1),
        "p50_ms": _ms_percentile(run["latencies"], 50),
        "p99_ms": _ms_percentile(run["latencies"], 99),
        "refused_503": run["refused"], "lost": len(expected - set(run["answers"])),
        "duplicated": sum(n - 1 for n in run["counts"].values() if n > 1),
        "different_from_first_mode": sum(run["answers"][k] != reference.get(k)
                                       for k in run["answers"] if k in reference),
        "batches": stats["batches"],
        "sentences_per_batch": round(stats["sentences"] / max(stats["batches"], 1), 2),
        "padded_rows": stats["rows"] - stats["sentences"],
        # GET /metrics against the clients' own counts (long sources split in pieces are
        # decoded as several sentences).
        "server_counted": counted,
        "server_counts_agree": (counted["requests_200"] == sum(run["counts"].values())
                                and counted["refused_503"] == run["refused"]
                                and counted["sentences"] >= answered),
        "errors": run["errors"][:5], "exit_status": status,
        "server_flags": flags[mode] + args.server_flags.split()}
    results[mode] = row
    print(json.dumps(row), flush=True)
  if "default" in results and "one_at_a_time" in results:
    speedup = results["default"]["sentences_per_s"] / results["one_at_a_time"]["sentences_per_s"]
    print(f"default / one request at a time: {speedup:.2f}x sentences/s")
  import jax  # noqa: PLC0415
  out = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
         "cpu": cpu_model(), "cores": os.cpu_count(),
         "jax": jax.__version__, "modes": results}
  print(f"{'mode':<12}{'ready s':>9}{'sent/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'a batch':>9}"
        f"{'503s':>7}{'lost':>6}{'dup':>5}{'diff':>6}{'exit':>6}")
  for r in results.values():
    print(f"{r['mode']:<12}{r['ready_s']:>9}{r['sentences_per_s']:>9}{r['p50_ms']!s:>9}"
          f"{r['p99_ms']!s:>9}{r['sentences_per_batch']:>9}{r['refused_503']:>7}{r['lost']:>6}"
          f"{r['duplicated']:>5}{r['different_from_first_mode']:>6}{r['exit_status']:>6}")
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def _ms_percentile(seconds: list[float], q: float) -> float | None:
  """The q-th percentile, in ms: the sample nearest to it (as the recorded figures were)."""
  return round(1000 * float(np.percentile(seconds, q, method="nearest")), 1) if seconds else None


if __name__ == "__main__":
  main()
