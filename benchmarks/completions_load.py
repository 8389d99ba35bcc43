"""Load test of a language model's completions server on localhost: concurrent streaming
clients against one request at a time, tokens/s and the latency to the first streamed token.

  python benchmarks/completions_load.py --workdir runs/lm_shakespeare --clients 16 \
      --requests 8 --max_tokens 64 --json completions_load.json

Each mode starts `python -m transformer_jax serve` on a free port, waits for /ready, sends the
same requests (prompts cut from the start of random lines of the held-out works' text, 8 to 24
tokens, sampled at temperature 1 with a seed of their own, streamed) and stops the server with
SIGTERM (its exit status is checked); a round of short requests before each mode's timed one
loads and first runs its programs. Modes:
  batched        --clients threads at once, each sending --requests requests in turn, on the
                 server as it ships (decoding slots that sequences join as they come)
  one_at_a_time  the same server, every request in turn from one client
  one_slot       every request in turn from one client, on `serve --slots 1` (the strongest
                 configuration for one request at a time: every step computes one row)
  first_token    one request at a time, streaming one token, for prompts of each of
                 --first_token_lengths tokens (at most the model's max_len - 2): the median of
                 five requests each
`--long_share 0.25` makes every fourth prompt long (max_len - max_tokens - 8 tokens): the other
streams' inter-token latency shows how much reading a long prompt stalls them.
Tokens/s counts the completion tokens (the servers' usage) over the clients' wall time; the
first-token latency is from sending a request to its first piece of text. Every mode's texts
are compared with the first mode's (seeded: they must be equal). GET /metrics, scraped before
and after each mode's timed clients, gives the requests, completion tokens and first events
the server counted, checked against the clients' counts (`server_counts_agree`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.serve_load import get, scraped, start_server, stop_server, wait_ready  # noqa: E402
import portpicker  # noqa: E402


def prompts_for(workdir: str, data_dir: str, count: int, seed: int = 0,
                long_share: float = 0.0, long_tokens: int = 0) -> list[str]:
  """`count` prompts: the starts (8 to 24 tokens) of random lines of six words or more of the
  validation works in `data_dir` (the works the run held out); every 1 / long_share-th (where
  positive) instead `long_tokens` tokens of those works' running text from a random line."""
  from transformer_jax.data import builders
  from transformer_jax.runs.workdir import Workdir
  tokenizer = Workdir(workdir).tokenizers().tgt
  works = builders.read_documents(Path(data_dir))
  held_out = builders.document_splits(list(works))["validation"]
  lines = [line for name in held_out for line in works[name].splitlines()
           if len(line.split()) >= 6]
  text = "\n".join(works[name] for name in held_out)
  rng = random.Random(seed)
  out = []
  for i in range(count):
    if long_share and i % round(1 / long_share) == round(1 / long_share) - 1:
      start = rng.randrange(len(text) - 20 * long_tokens)
      ids = tokenizer.encode([text[start:start + 20 * long_tokens]])[0][:long_tokens]
    else:
      ids = tokenizer.encode([rng.choice(lines)])[0][:rng.randint(8, 24)]
    out.append(tokenizer.decode(ids))
  return out


def stream(port: int, body: dict) -> tuple[str, float | None, int, list[float]]:
  """(text, seconds to the first piece of text, completion tokens, seconds between one piece
  of text and the next) of one streamed request."""
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  began = time.monotonic()
  connection.request("POST", "/v1/completions", body=json.dumps(
      {**body, "stream": True, "stream_options": {"include_usage": True}}),
      headers={"Content-Type": "application/json"})
  response = connection.getresponse()
  if response.status != 200:
    raise RuntimeError(f"{response.status}: {response.read()[:300]!r}")
  text, first, tokens, gaps, last = [], None, 0, [], None
  while line := response.fp.readline():
    if line.strip() == b"data: [DONE]":
      break
    if not line.startswith(b"data: "):
      continue
    chunk = json.loads(line[6:])
    if chunk.get("usage"):
      tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk["choices"]:
      now = time.monotonic()
      if choice["text"] and first is None:
        first = now - began
      elif choice["text"]:
        gaps.append(now - last)
      if choice["text"]:
        last = now
      text.append(choice["text"])
  connection.close()
  return "".join(text), first, tokens, gaps


def run_mode(port: int, plan: list[list[dict]]) -> dict:
  """Each client of `plan` (its requests) in a thread of its own."""
  results: dict[tuple[int, int], tuple] = {}
  errors: list[str] = []

  def client(c: int) -> None:
    for r, body in enumerate(plan[c]):
      try:
        results[c, r] = stream(port, body)
      except Exception as e:  # Counted and shown: a benchmark that hides one is wrong.
        errors.append(repr(e))

  threads = [threading.Thread(target=client, args=(c,)) for c in range(len(plan))]
  began = time.monotonic()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return {"wall_s": time.monotonic() - began, "results": results, "errors": errors}


# What the completions server counts of a mode's clients.
COUNTED = {"requests_200": ("transformer_jax_requests_total",
                            {"endpoint": "/v1/completions", "status": "200"}),
           "completion_tokens": ("transformer_jax_completion_tokens_total", {}),
           "first_events": ("transformer_jax_first_event_seconds_count",
                            {"endpoint": "/v1/completions"})}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--data_dir", default="data/shakespeare", help="The works the run was "
                      "trained on (prompts come from its validation works).")
  parser.add_argument("--clients", type=int, default=16)
  parser.add_argument("--requests", type=int, default=8, help="Requests per client.")
  parser.add_argument("--max_tokens", type=int, default=64)
  parser.add_argument("--modes", default="batched,one_at_a_time,one_slot",
                      help="Of batched, one_at_a_time, one_slot, first_token.")
  parser.add_argument("--first_token_lengths", default="16,128,512")
  parser.add_argument("--long_share", type=float, default=0.0, help="The share of requests "
                      "whose prompts are long: the model's max_len less --max_tokens and 8.")
  parser.add_argument("--server_flags", default="", help="More serve flags, space-separated.")
  parser.add_argument("--logs", default=None, help="A directory for the servers' logs.")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  name = Path(args.workdir).absolute().name
  from transformer_jax.runs.workdir import Workdir
  long_tokens = Workdir(args.workdir).load_config().data.max_len - args.max_tokens - 8
  prompts = prompts_for(args.workdir, args.data_dir, args.clients * args.requests,
                        long_share=args.long_share, long_tokens=long_tokens)
  bodies = [{"model": name, "prompt": p, "max_tokens": args.max_tokens, "temperature": 1.0,
             "seed": i} for i, p in enumerate(prompts)]
  batched = [bodies[c * args.requests:(c + 1) * args.requests] for c in range(args.clients)]
  plans = {"batched": batched, "one_at_a_time": [bodies], "one_slot": [bodies]}
  flags = {"batched": [], "one_at_a_time": [], "one_slot": ["--slots=1"]}
  logs = Path(args.logs) if args.logs else None
  if logs:
    logs.mkdir(parents=True, exist_ok=True)
  rows, reference = {}, None
  modes = args.modes.split(",")
  if "first_token" in modes:
    modes.remove("first_token")
    rows["first_token"] = first_token_times(args, name, logs)
    print(json.dumps(rows["first_token"]), flush=True)
  for mode in modes:
    port = portpicker.pick_unused_port()
    log = open(logs / f"{mode}.log" if logs else os.devnull, "w")
    server = start_server(args.workdir, port, *flags[mode], *args.server_flags.split(), log=log)
    ready = wait_ready(server, port)
    # Not timed: a first call of each program the mode runs (loading it, a first run).
    warm = [{**body, "max_tokens": 8, "seed": 10 ** 6} for body in bodies[:args.clients]]
    run_mode(port, [[body] for body in warm] if len(plans[mode]) > 1 else [warm[:2]])
    run, counted = scraped(port, lambda: run_mode(port, plans[mode]), COUNTED)
    stats = get(port, "/stats")[1]
    status = stop_server(server)
    texts = [None] * len(bodies)
    for (c, r), result in run["results"].items():
      texts[plans[mode][c][r]["seed"]] = result[0]
    if reference is None:
      reference = texts
    firsts = [r[1] for r in run["results"].values() if r[1] is not None]
    # Between the pieces of the short prompts' streams (the long ones' prompts are read
    # meanwhile).
    short = [r for (c, i), r in run["results"].items()
             if not _is_long(plans[mode][c][i]["seed"], args.long_share)]
    gaps = [g for r in short for g in r[3]]
    tokens = sum(r[2] for r in run["results"].values())
    row = {"mode": mode, "ready_s": round(ready, 1), "requests": len(run["results"]),
           "completion_tokens": tokens, "wall_s": round(run["wall_s"], 2),
           "tokens_per_s": round(tokens / run["wall_s"], 1),
           "first_token_p50_ms": _ms(firsts, 50), "first_token_p95_ms": _ms(firsts, 95),
           "inter_token_p50_ms": _ms(gaps, 50), "inter_token_p99_ms": _ms(gaps, 99),
           "long_prompts": sum(_is_long(b["seed"], args.long_share) for b in bodies),
           "long_prompt_tokens": long_tokens if args.long_share else 0,
           "different_from_first_mode": sum(a != b for a, b in zip(texts, reference)),
           "decoder_runs": stats["runs"], "busy_s": round(stats["busy_seconds"], 2),
           # GET /metrics against the clients' own counts (every request streams).
           "server_counted": counted,
           "server_counts_agree": counted == {"requests_200": len(run["results"]),
                                              "completion_tokens": tokens,
                                              "first_events": len(run["results"])},
           "errors": run["errors"][:5], "exit_status": status,
           "server_flags": flags[mode] + args.server_flags.split()}
    rows[mode] = row
    print(json.dumps(row), flush=True)
  for base in ("one_at_a_time", "one_slot"):
    if "batched" in rows and base in rows:
      print(f"batched / {base}: "
            f"{rows['batched']['tokens_per_s'] / rows[base]['tokens_per_s']:.2f}x tokens/s")
  import jax  # noqa: PLC0415
  out = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
         "cores": os.cpu_count(), "jax": jax.__version__, "modes": rows}
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def first_token_times(args, name: str, logs: Path | None) -> dict:
  """The first_token mode: {prompt tokens: median ms to the first piece of text}."""
  from transformer_jax.runs.workdir import Workdir
  max_len = Workdir(args.workdir).load_config().data.max_len
  port = portpicker.pick_unused_port()
  log = open(logs / "first_token.log" if logs else os.devnull, "w")
  server = start_server(args.workdir, port, *args.server_flags.split(), log=log)
  ready = wait_ready(server, port)
  times, prompt_tokens = {}, {}
  for n in [min(int(n), max_len - 2) for n in args.first_token_lengths.split(",")]:
    prompts = prompts_for(args.workdir, args.data_dir, 7, seed=n, long_share=1.0,
                          long_tokens=n - 1)  # With <bos>, n tokens.
    firsts = []
    for i, prompt in enumerate(prompts):
      body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
      text, first, tokens, _ = stream(port, body)
      if i >= 2:  # The first two load and first run the programs.
        firsts.append(first)
    usage = get_usage(port, name, prompts[0])
    prompt_tokens[n] = usage
    times[n] = round(1000 * statistics.median(firsts), 1)
  status = stop_server(server)
  return {"mode": "first_token", "ready_s": round(ready, 1), "first_token_ms": times,
          "prompt_tokens": prompt_tokens, "exit_status": status,
          "server_flags": args.server_flags.split()}


def get_usage(port: int, name: str, prompt: str) -> int:
  """The prompt tokens the server counts for `prompt` (its usage, <bos> aside)."""
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  connection.request("POST", "/v1/completions", body=json.dumps(
      {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}),
      headers={"Content-Type": "application/json"})
  answer = json.loads(connection.getresponse().read())
  connection.close()
  return answer["usage"]["prompt_tokens"]


def _is_long(number: int, share: float) -> bool:
  """Whether request `number` has a long prompt (prompts_for's rule)."""
  return bool(share) and number % round(1 / share) == round(1 / share) - 1


def _ms(seconds: list[float], q: float) -> float | None:
  return round(1000 * float(np.percentile(seconds, q, method="nearest")), 1) if seconds else None


if __name__ == "__main__":
  main()
