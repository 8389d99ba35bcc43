"""Parses many command lines of one command in one process, as the command parses its own:
`python tests/parse_commands.py COMMAND` reads a JSON list of argvs (each the command's own,
from its program name on) from standard input and writes a JSON object: `errors`, for each argv the command's one-line
error or absl's message (None where it parsed), and `flags`, the names of the flags the
command defines (to check that a documented flag is one of them). The config file, its
variant and every override are read (absl's config_flags loads them while parsing); nothing is
run. One process instead of one for each documented command: an import of jax and the
project is seconds of a 2-core CPU."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # configs/, train.py's imports.


def _parse(argv: list[str]) -> str | None:
  """The command's parse of `argv`: its one-line error or absl's message, or None."""
  from transformer_jax.commands import launch
  out = io.StringIO()
  sys.argv = argv  # config_flags reads the overrides from sys.argv.
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      launch.parse_flags(argv)
  except SystemExit as e:  # parse_flags' one line, or absl's usage error.
    return str(e.code) if e.code not in (None, 0) else None
  except Exception as e:  # noqa: BLE001  Reported for the test to show.
    return f"{type(e).__name__}: {e}"
  return out.getvalue()[-2000:] if "error" in out.getvalue().lower() else None


def main() -> None:
  from absl import flags
  name = sys.argv[1]
  importlib.import_module(f"transformer_jax.commands.{name}").define_flags()
  errors = []
  for argv in json.load(sys.stdin):
    # Each in a child forked from this process (the imports done once): absl's config_flags
    # defines the override flags while parsing and does not parse a second command line.
    read, write = os.pipe()
    if (child := os.fork()) == 0:
      os.close(read)
      with os.fdopen(write, "w") as pipe:
        json.dump(_parse(argv), pipe)
      os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
      answer = pipe.read()
    os.waitpid(child, 0)
    errors.append(json.loads(answer) if answer else "the parse ended without an answer")
  json.dump({"flags": sorted(flags.FLAGS), "errors": errors}, sys.stdout)


if __name__ == "__main__":
  main()
