"""How soon the translation server answers after it starts, on an empty and on a filled cache.

  python benchmarks/serve_ready.py --workdir runs/fra_eng --json serve_ready.json

Starts `python -m transformer_jax serve` twice with a compilation cache of its own (a new
empty folder: `--compilation_cache_dir`), so the first start compiles every program and the
second loads what the first kept. Each start records the seconds until GET /ready answers 200,
then sends one request of one sentence with the workdir's beam size and one greedy, and records
when each was answered (the first answers may wait for a program still compiling) and the
server's shapes compiled by then; then it stops the server with SIGTERM (its exit status kept).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_model  # noqa: E402
from benchmarks.serve_load import get, post, start_server, stop_server, wait_ready  # noqa: E402


def one_start(workdir: str, cache: str, sentence: str, flags: list[str], log) -> dict:
  """One server start: seconds to /ready, to each first answer, and the exit status."""
  import portpicker  # noqa: PLC0415 -- test dependency, imported when run.
  port = portpicker.pick_unused_port()
  started = time.monotonic()
  server = start_server(workdir, port, f"--compilation_cache_dir={cache}", *flags, log=log)
  try:
    ready_s = wait_ready(server, port)
    row = {"ready_s": round(ready_s, 1), "shapes_at_ready": get(port, "/ready")[1]}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    for name, request in (("default_beam", {"sentences": [sentence]}),
                          ("greedy", {"sentences": [sentence], "beam_size": 1})):
      status, body, _ = post(connection, request)
      row[f"{name}_answered_s"] = round(time.monotonic() - started, 1)
      row[f"{name}_status"] = status
      row[f"{name}_text"] = body["translations"][0]["text"] if status == 200 else body
    connection.close()
    row["shapes_after"] = get(port, "/ready")[1]
  finally:
    row["exit_status"] = stop_server(server)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--sentence", default="I think that we should leave before it rains.")
  parser.add_argument("--server_flags", default="", help="More serve flags, space-separated.")
  parser.add_argument("--logs", default=None, help="A directory for the servers' logs.")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  flags = args.server_flags.split()
  rows = {}
  with tempfile.TemporaryDirectory() as cache:
    for name in ("fresh", "warm"):
      if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
      log = open(Path(args.logs) / f"serve_{name}.log", "w") if args.logs else None
      rows[name] = one_start(args.workdir, cache, args.sentence, flags, log)
      print(name, json.dumps(rows[name]), flush=True)
  import jax  # noqa: PLC0415
  out = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
         "cores": os.cpu_count(), "jax": jax.__version__, "server_flags": flags, "starts": rows}
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
  main()
