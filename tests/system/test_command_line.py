"""Every command's --help and bad flag values, and the input a command reads as a user's tools
count it: each answer is the command's flags, or one `error:` line."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import portpicker
import pytest

from tests.conftest import ROOT
from tests.system.test_user_mistakes import _one_error_line, _run

COMMANDS = ("train", "translate", "fill", "average", "visualize", "aot", "export", "serve",
            "report")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_the_commands_flags_and_exits_0(command):
  result = _run("-m", "transformer_jax", command, "--help", timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "--workdir" in result.stdout or command == "aot"
  assert "flags:" in result.stdout and "--helpfull" not in result.stdout
  if command == "aot":
    assert "--topology:" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["translate", "--workdir=w", "--beam_size=abc", "Hi."],
     "error: flag --beam_size=abc: invalid literal for int() with base 10: 'abc'"),
    (["serve", "--workdir=w", "--port=x"],
     "error: flag --port=x: invalid literal for int() with base 10: 'x'"),
    (["translate", "--workdir=w", "--lanes=0", "Hi."],
     "error: --lanes must be 'auto' or a positive count, got '0'"),
    (["export", "--workdir=w", "--to=onnx", "out"],
     "error: flag --to=onnx: value should be one of <ctranslate2|jax|huggingface>"),
    (["report", "--workdir=w"], "error: --workdir w does not exist"),
    (["serve", "--workdir=w", "--api_key="],  # Before the workdir is read.
     "error: --api_key (or TRANSFORMER_JAX_API_KEY) is empty: give a key, or unset it"),
])
def test_a_bad_flag_value_is_one_line(args, message):
  assert _one_error_line(_run("-m", "transformer_jax", *args, timeout=120)) == message


def test_serve_without_its_extra_names_the_install(trained):
  _, workdir = trained
  script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split(".")[0] in {{"uvicorn", "starlette"}}:
      raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = ["transformer_jax", "serve", "--workdir={workdir}", "--port={portpicker.pick_unused_port()}"]
from transformer_jax.__main__ import main
main()
"""
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert _one_error_line(result) == (
      "error: serve needs the serve extra (uvicorn is not installed): pip install "
      "'.[serve]' in the project's folder")


def test_two_servers_started_together_one_serves_one_says_why_not(trained, tmp_path):
  """The address is taken before the model loads: the second server's error is one line."""
  from benchmarks.serve_load import start_server, stop_server, wait_ready
  _, workdir = trained
  port = portpicker.pick_unused_port()
  logs = [open(tmp_path / f"s{i}.log", "w") for i in range(2)]
  servers = [start_server(str(workdir), port, log=log) for log in logs]
  try:
    deadline = time.monotonic() + 300
    while all(s.poll() is None for s in servers) and time.monotonic() < deadline:
      time.sleep(0.2)
    losers = [i for i, s in enumerate(servers) if s.poll() is not None]
    assert len(losers) == 1, [(tmp_path / f"s{i}.log").read_text()[-2000:] for i in range(2)]
    loser = losers[0]
    wait_ready(servers[1 - loser], port, timeout=600)
    text = (tmp_path / f"s{loser}.log").read_text()
    assert servers[loser].returncode == 1, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"), text
    assert "Traceback" not in text
  finally:
    for s in servers:
      if s.poll() is None:
        assert stop_server(s) == 0


def test_translate_counts_lines_as_wc_does_and_refuses_a_line_without_tokens(trained, tmp_path):
  _, workdir = trained
  carriage = tmp_path / "cr.txt"
  carriage.write_bytes(b"Hello.\rGo on.\r\nBye.\n")  # A lone \r inside line 1; CRLF ends it.
  out = tmp_path / "out.txt"
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "--input",
                str(carriage), "--output", str(out))
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(out.read_text().splitlines()) == 2  # wc -l: 2.

  invisible = tmp_path / "zw.txt"
  invisible.write_text("Hello.\n\u200b\nGo.\n")
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "--input",
                str(invisible), "--output", str(out))
  assert _one_error_line(result) == ("error: sentence 2 is empty (it holds no character the "
                                     "tokenizer keeps: '\\u200b')")
  assert "translating" not in result.stderr  # Refused before the model loaded.


def test_translate_leaves_at_once_with_every_line_written(trained, tmp_path):
  """translate ends its process without tearing jax down (__main__.END_AT_ONCE): what it
  printed to a pipe is there whole, and so is its exit status."""
  _, workdir = trained
  source = tmp_path / "in.txt"
  source.write_text("".join(f"Go {i}.\n" for i in range(40)))
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "--input",
                str(source))
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(result.stdout.splitlines()) == 40


def test_a_first_translate_keeps_every_run_size_and_a_later_one_compiles_nothing(trained,
                                                                                  tmp_path):
  """The first command with an empty cache also compiles the run sizes its traffic did not
  meet (a later command's lanes, timed differently, may shrink to one), after its output is
  written; the next command then finds every program it calls kept, and the model's abstract
  parameters (no init traced)."""
  from transformer_jax.decoding import platforms, slots
  _, workdir = trained
  source = tmp_path / "in.txt"
  source.write_text("".join(f"Go {i}.\n" for i in range(40)))
  cache = tmp_path / "cache"
  translate = ["-m", "transformer_jax", "translate", "--workdir", str(workdir), "--input",
               str(source), "--compilation_cache_dir", str(cache), "--lanes", "1"]
  first = _run(*translate, "--output", str(tmp_path / "first.txt"))
  assert first.returncode == 0, first.stderr[-2000:]
  assert "other run sizes for later commands" in first.stderr
  kept = {path.name for path in (cache / "programs").glob("*.executable")}
  runs = {int(name.split("-")[0].rpartition("_")[2]) for name in kept
          if name.startswith("slots_run_")}
  # The slots (as many as the sources ask for, at most the default), then every size below,
  # quartered (a file's).
  assert set(slots.run_sizes(max(runs), platforms.CPU.min_rows_fraction,
                             slots.RUN_RATIO["file"])) == runs
  assert len(runs) >= 3, runs
  (abstract,) = (cache / "programs").glob("abstract_params-*.pickle")
  written = abstract.stat().st_ino  # A file written again is a new file (fs.replace_file).
  later = _run(*translate, "--output", str(tmp_path / "later.txt"))
  assert later.returncode == 0, later.stderr[-2000:]
  assert "other run sizes" not in later.stderr  # It compiled nothing,
  assert {path.name for path in (cache / "programs").glob("*.executable")} == kept  # nor kept.
  assert abstract.stat().st_ino == written  # Read back, not written again.
  assert (tmp_path / "later.txt").read_text() == (tmp_path / "first.txt").read_text()


_CTRL_C_WHILE_COMPILING_FOR_LATER = """
import sys
from transformer_jax.decoding import translator
def interrupted(self):
  raise KeyboardInterrupt
translator.Translator.compile_slot_programs = interrupted
sys.argv = ["python -m transformer_jax translate", *sys.argv[1:]]
from transformer_jax.commands import translate
translate.run()
"""


def test_ctrl_c_while_compiling_for_later_commands_keeps_the_written_output(trained, tmp_path):
  _, workdir = trained
  source, out = tmp_path / "in.txt", tmp_path / "out.txt"
  source.write_text("Go.\nHello.\n")
  result = _run("-c", _CTRL_C_WHILE_COMPILING_FOR_LATER, "--workdir", str(workdir), "--input",
                str(source), "--output", str(out), "--compilation_cache_dir",
                str(tmp_path / "cache"))
  assert _one_error_line(result, returncode=130) == (
      "error: interrupted while compiling programs for later commands; the translations were "
      "written")
  assert len(out.read_text().splitlines()) == 2


def test_a_field_of_the_wrong_type_in_config_json_is_one_line(trained, tmp_path):
  import json
  import shutil
  _, source = trained
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  saved = json.loads((workdir / "config.json").read_text())
  saved["decode"]["beam_size"] = 2.5
  (workdir / "config.json").write_text(json.dumps(saved))
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "Go.")
  assert _one_error_line(result) == (f"error: {workdir / 'config.json'} is damaged "
                                     "(decode.beam_size=2.5 must be int); restore it from a copy")


_FREED_AND_TAKEN_AGAIN = """
import ctypes
import resource
import numpy as np
from transformer_jax.commands import launch
assert launch.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.memset.argtypes = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
libc.free.argtypes = ctypes.c_void_p,
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 48 MB in three blocks, freed, 20 times.
  blocks = [np.ones((16 << 20) // 8) for _ in range(3)]
  del blocks
for _ in range(5):  # A block of 512 MB, more than the heap's free top, as XLA's buffers are
  block = libc.malloc(512 << 20)  # allocated: malloc's own pages (numpy asks for huge pages).
  libc.memset(block, 1, 512 << 20)
  libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_decoding_commands_keep_freed_memory_for_their_next_allocations():
  """launch.keep_freed_memory (which translate and serve call): blocks freed and allocated
  again are paged in once, not at every round, whatever their size (glibc's defaults gave back
  the heap's top: 21,000 to 31,000 page faults in two runs for the three 16 MB blocks on the
  machine this test was written on, against 1,518 with the setting; a block over 32 MB that
  the heap cannot hold is mapped afresh at every allocation unless glibc's mmap is off: 5
  rounds of the 512 MB block are 655,360 pages of 4 KB)."""
  result = subprocess.run([sys.executable, "-c", _FREED_AND_TAKEN_AGAIN], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  one_round = (3 * (16 << 20) + (512 << 20)) // 4096  # Pages of 4 KB.
  assert int(result.stdout) < 1.5 * one_round


def _ledger_line(**changes) -> str:
  line = {"life": 1, "host": "h", "pid": 7, "started": 0.0, "updated": 10.0, "from_step": 0,
          "step": 5, "recomputed_steps": 0, "seconds": {"step": 9.0, "startup": 1.0}}
  return json.dumps({**line, **changes})


@pytest.mark.parametrize("files,message", [
    ({"goodput.jsonl": json.dumps({"life": "x", "seconds": 5})},
     "error: {w}/goodput.jsonl line 1 is not a goodput ledger line (its 'life' is 'x', not int)"),
    ({"goodput.jsonl": _ledger_line(seconds={"step": "a lot"}), "metrics.jsonl": ""},
     "error: {w}/goodput.jsonl line 1 is not a goodput ledger line (its seconds are not "
     "numbers)"),
    ({"goodput.jsonl": _ledger_line(), "metrics.jsonl": b"\xff\xfe{}"},
     "error: {w}/metrics.jsonl is not UTF-8 text (byte 0): not a run's metrics"),
    ({"goodput.jsonl": ""},
     "error: {w} holds no goodput.jsonl (it is empty) and no metrics.jsonl: train.py writes "
     "both from its first step"),
    ({"goodput.jsonl": _ledger_line()},
     "error: {w} holds no metrics.jsonl (only goodput.jsonl): train.py writes both from its "
     "first step"),
    ({"metrics.jsonl": '{"step": 1}'},
     "error: {w} holds no goodput.jsonl (only metrics.jsonl): train.py writes both from its "
     "first step"),
    (None, "error: --workdir {w} is a file, not a training workdir"),
])
def test_report_names_what_a_workdir_holds_and_lacks(tmp_path, files, message):
  workdir = tmp_path / "w"
  if files is None:
    workdir.write_text("a file")
  else:
    workdir.mkdir()
    for name, content in files.items():
      (workdir / name).write_bytes(content if isinstance(content, bytes) else content.encode())
  result = _run("-m", "transformer_jax", "report", "--workdir", str(workdir), timeout=120)
  assert _one_error_line(result) == message.format(w=workdir)
  assert not (tmp_path / "w" / "report.png").exists() if files is not None else True


def test_report_draws_a_ledger_and_metrics_it_can_read(tmp_path):
  workdir = tmp_path / "w"
  workdir.mkdir()
  (workdir / "goodput.jsonl").write_text(_ledger_line() + "\n" + '{"torn": ')
  (workdir / "metrics.jsonl").write_text('{"step": 5, "train/loss": 2.5}\n[1, 2]\n'
                                         '{"step": 6, "train/loss": "n/a"}\n')
  result = _run("-m", "transformer_jax", "report", "--workdir", str(workdir), timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "1 life, 10.0 s of wall time, step 5 reached; goodput 90.0%" in result.stdout
  assert (workdir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
