"""Mistakes a new user makes: each ends in one `error:` line (no traceback), with an exit status
that says so, and changes nothing that was intact (checkpoints are never renamed for a mismatch)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transformer_jax import config as config_lib
from transformer_jax.training import trainer
from tests import runs
from tests.conftest import DATA, ROOT
from transformer_jax.data import pipeline
from transformer_jax.data.packing import NoPairsError


def _run(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _one_error_line(result, returncode=1) -> str:
  """The error line of a command that failed as a user-facing error; checks the rest."""
  assert result.returncode == returncode, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == errors[0]
  return errors[0]


def _tree_digest(directory: Path) -> dict[str, str]:
  """{relative path: sha256} of every file under `directory` (names and bytes)."""
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def _train_args(config, workdir, num_steps=None):
  """train.py's command line for the `trained` fixture's run (`num_steps`: to go on)."""
  return ["train.py", "--config", "configs/fra_eng.py:smoke", "--workdir", str(workdir),
          f"--config.data.data_dir={config.data.data_dir}",
          f"--config.data.tfds_dir={config.data.tfds_dir}",
          f"--config.run.compilation_cache_dir={config.run.compilation_cache_dir}",
          "--config.eval.bleu_sentences=0", "--config.data.num_workers=0",
          f"--config.step.ema_decay={config.step.ema_decay}",
          *([f"--config.run.num_steps={num_steps}"] if num_steps else [])]


def _with_another_tokenizer(trained, tmp_path, **data_fields):
  """A copy of the trained run whose tokenizer.model is replaced by the one fitted on the same
  data with other `data_fields`; (workdir, that tokenizer's directory)."""
  config, source = trained
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  other = config.copy_and_resolve_references()
  other.data.update(data_fields)
  pipeline.prepare(config_lib.parse(other).data, tmp_path / "other")
  shutil.copy(tmp_path / "other" / "tokenizer.model", workdir / "tokenizer.model")
  return workdir, tmp_path / "other"


def test_a_tokenizer_of_another_vocabulary_is_a_mismatch_not_damage(trained, tmp_path):
  config, _ = trained
  workdir, _ = _with_another_tokenizer(trained, tmp_path, vocab_size=1000)
  before, whole = _tree_digest(workdir / "checkpoints"), _tree_digest(workdir)

  expected = (f"error: the checkpoint of step 20 in {workdir / 'checkpoints'} is intact but was "
              "trained with another vocabulary: params.src_embed.embedding has 512 rows there, "
              "1024 from the workdir's tokenizer")
  line = _one_error_line(_run(*_train_args(config, workdir, num_steps=30)))
  assert line.startswith(expected) and line.endswith("Nothing was changed on disk"), line
  assert _tree_digest(workdir) == whole  # config.json (num_steps) too.

  # The run kept a moving average: translate restores it (ema_params) in place of params.
  translate = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "Go.")
  assert _one_error_line(translate).startswith(expected.replace("params.", "ema_params."))
  assert translate.stdout == ""
  visualize = _run("-m", "transformer_jax", "visualize", "--workdir", str(workdir), "--out",
                   str(tmp_path / "maps"), "Go.")
  assert _one_error_line(visualize).startswith(expected.replace("params.", "ema_params."))
  assert not (tmp_path / "maps").exists()
  average = _run("-m", "transformer_jax", "average", "--workdir", str(workdir), "--last", "2",
                 "--output", str(tmp_path / "avg"))
  assert _one_error_line(average).startswith(
      f"error: the checkpoint of step 10 in {workdir / 'checkpoints'} is intact but was trained "
      "with another vocabulary")
  assert not (tmp_path / "avg").exists() and not list(tmp_path.glob(".avg.partial-*"))
  assert _tree_digest(workdir / "checkpoints") == before


def test_translate_with_a_damaged_config_json_is_one_line(trained, tmp_path):
  _, source = trained
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  (workdir / "config.json").write_text('{"model": ')
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "Go.")
  assert _one_error_line(result).startswith(
      f"error: {workdir / 'config.json'} is damaged (Expecting value")
  result = _run("-m", "transformer_jax", "average", "--workdir", str(workdir), "--output",
                str(tmp_path / "avg"))
  assert _one_error_line(result).startswith(f"error: {workdir / 'config.json'} is damaged")


def test_an_empty_input_with_a_reference_is_one_line(trained, tmp_path):
  _, workdir = trained
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "blank.txt").write_text("\n  \n")
  for name in ("empty.txt", "blank.txt"):
    path = tmp_path / name
    result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "--input",
                  str(path), "--reference", str(path), "--output", str(tmp_path / "out.txt"))
    assert _one_error_line(result) == (
        f"error: --input {path} holds no sentence: nothing to translate or score")
    assert not (tmp_path / "out.txt").exists()


def _long_pairs_tsv(path: Path, n: int, words: int) -> None:
  path.write_text("".join(f"{' '.join(['word'] * words)} {i}\t"
                          f"{' '.join(['mot'] * words)} {i}\n" for i in range(n)))


def test_a_corpus_that_leaves_nothing_to_train_on_is_one_line(tmp_path, cache_dir):
  data = tmp_path / "data"
  data.mkdir()
  _long_pairs_tsv(data / "train.tsv", 300, words=80)  # Every pair over max_len=32.
  _long_pairs_tsv(data / "validation.tsv", 20, words=3)
  workdir = tmp_path / "w"
  result = _run("train.py", "--config", "configs/fra_eng.py:smoke", "--workdir", str(workdir),
                "--config.data.dataset=parallel_tsv", f"--config.data.data_dir={data}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}", "--config.data.num_workers=0",
                "--config.data.train_split=train", "--config.data.eval_split=validation",
                f"--config.run.compilation_cache_dir={cache_dir}")
  assert _one_error_line(result) == (
      "error: the training split leaves no pair to use: all 300 are empty or over "
      "data.max_len=32 tokens a side (with <eos>); raise data.max_len, set "
      "data.overlong='truncate' or check the data")
  assert not (workdir / "checkpoints").exists()


def test_an_evaluation_split_that_keeps_no_pair_fails_before_training(smoke_config, tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  _long_pairs_tsv(data / "train.tsv", 300, words=3)
  _long_pairs_tsv(data / "validation.tsv", 20, words=80)
  smoke_config.data.update(dataset="parallel_tsv", data_dir=str(data),
                           tfds_dir=str(tmp_path / "t"), train_split="train",
                           eval_split="validation", num_workers="0")
  smoke_config.eval.bleu_sentences = 0
  with pytest.raises(NoPairsError, match=r"^the evaluation split leaves no pair to use: all 20"):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w" / "checkpoints").exists()
  assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_ctrl_c_while_the_dataset_is_prepared_exits_130_and_the_next_run_goes_on(tmp_path,
                                                                               cache_dir):
  workdir, tfds = tmp_path / "w", tmp_path / "tfds"
  command = [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
             "--workdir", str(workdir), f"--config.data.data_dir={DATA / 'fra-eng'}",
             f"--config.data.tfds_dir={tfds}", f"--config.run.compilation_cache_dir={cache_dir}",
             "--config.data.num_workers=0", "--config.eval.bleu_sentences=0"]
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, preexec_fn=runs.sigint_at_its_default)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "Generating dataset fra_eng" in line:  # tfds has begun writing the dataset.
      proc.send_signal(signal.SIGINT)
      break
  else:
    raise AssertionError("".join(seen[-20:]))
  rest = proc.communicate(timeout=300)[0]
  assert proc.returncode == 130, rest[-3000:]
  assert "Traceback" not in rest
  assert rest.strip().splitlines()[-1] == (
      "error: interrupted before training started; nothing was saved. Run the same command to "
      "start again")
  assert not (workdir / "checkpoints").exists()
  leftovers = [p for p in tfds.rglob("*") if ".tmp-" in p.name]
  assert not leftovers  # No unfinished token cache.
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "20"]


def _interrupt_at(command: list[str], seconds: float) -> tuple[int | None, str, bool]:
  """Starts `command` as from a terminal (SIGINT at its default), sends SIGINT `seconds`
  after it started: (exit status, its output, whether the training loop had been reached
  when the signal went). None for the status where it ended before the signal."""
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, preexec_fn=runs.sigint_at_its_default)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  time.sleep(seconds)
  if proc.poll() is not None:
    reader.join()
    return None, "".join(lines), False
  looping = any("starting from scratch" in line for line in lines)
  proc.send_signal(signal.SIGINT)
  status = proc.wait(timeout=300)
  reader.join()
  return status, "".join(lines), looping


def _interrupted_in_one_line(status: int, out: str, *messages: str) -> None:
  assert "Segmentation fault" not in out and "Fatal Python error" not in out, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  assert status == 130, out[-3000:]
  assert out.strip().splitlines()[-1] in [f"error: {m}" for m in messages], out[-2000:]


@pytest.mark.parametrize("seconds", [0.6, 1.2, 1.8, 2.5, 3.5, 5.0])
def test_ctrl_c_at_any_moment_of_trainings_start_exits_130_in_one_line(seconds, tmp_path,
                                                                       cache_dir):
  """While the libraries load, the flags parse (the config, jax), the tokenizer is trained and
  the dataset written: exit 130 with one line and nothing saved; never a run that goes on
  to its end, nor a crash after the line. (Once the loop has begun, a Ctrl-C saves a
  checkpoint and exits 0: tests/system/test_reliability.py.)"""
  workdir = tmp_path / "w"
  command = runs.shakespeare_command("lm_shakespeare", workdir, tmp_path / "tfds", cache_dir)
  status, out, looping = _interrupt_at(command, seconds)
  if status is None:
    pytest.fail(f"train.py ended within {seconds} s: {out[-1000:]}")
  if looping and status == 0:
    return  # The signal met the loop: a checkpoint and exit 0, as documented.
  # Before train.py's body began (the libraries loading, the flags parsing), or in it.
  _interrupted_in_one_line(status, out, "interrupted; nothing was written", "interrupted "
                           "before training started; nothing was saved. Run the same command "
                           "to start again")
  assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


@pytest.mark.parametrize("seconds", [0.6, 1.5, 2.5, 4.0])
def test_ctrl_c_at_any_moment_of_average_or_export_exits_130_and_writes_nothing(
    seconds, trained, tmp_path):
  _, workdir = trained
  for command, out in (("average", tmp_path / "avg"), ("export", tmp_path / "hf")):
    flags = (["--last", "2", "--output", str(out)] if command == "average"
             else ["--to", "huggingface", str(out)])
    status, log, _ = _interrupt_at([sys.executable, "-m", "transformer_jax", command,
                                    "--workdir", str(workdir), *flags], seconds)
    if status is None or out.is_dir():  # It ended first, or its work had: what it wrote is
      assert status in (None, 0) and out.is_dir(), log[-2000:]  # whole.
      assert "Traceback" not in log and "Segmentation fault" not in log, log[-2000:]
      shutil.rmtree(out)
      continue
    _interrupted_in_one_line(status, log, "interrupted; nothing was written")
    assert not out.exists() and not list(tmp_path.glob(".*partial*")), log[-2000:]


@pytest.mark.parametrize("seconds", [0.1, 0.2, 0.3])
def test_ctrl_c_while_a_command_loads_its_libraries_exits_130_in_one_line(seconds, trained,
                                                                         lm_run):
  """Ctrl-C while `generate` or `translate` imports its libraries: a KeyboardInterrupt
  raised inside a module's import was printed as a traceback before the line, or aborted the
  interpreter (exit -6, -11), at 0.1 to 0.3 s. Now exit 130 and one line (3 tries a moment)."""
  _, workdir = trained
  for command in (["generate", "--workdir", str(lm_run), "ROMEO.", "--max_new_tokens", "4"],
                  ["translate", "--workdir", str(workdir), "I am home."]):
    for _ in range(3):
      status, out, _ = _interrupt_at([sys.executable, "-m", "transformer_jax", *command],
                                     seconds)
      assert status is not None, out[-2000:]  # Still starting when the signal went.
      _interrupted_in_one_line(status, out, "interrupted; nothing was written")


def test_ctrl_c_before_the_first_library_loads_exits_130_in_one_line():
  """A SIGINT at 0.1 s under load landed before `errors` was imported (in `logging`'s and
  `re`'s own imports): a KeyboardInterrupt traceback and exit -2 (3 of 600 tries). Both entry
  points now catch it first, before any other import."""
  import ast
  for entry in (ROOT / "transformer_jax" / "__main__.py", ROOT / "train.py"):
    body = [node for node in ast.parse(entry.read_text()).body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert ast.unparse(body[0]) == "from transformer_jax import starting", entry
    assert "starting.exit_130_on_ctrl_c()" in ast.unparse(body[1]), entry
  script = ("from transformer_jax import starting\n"
            "starting.exit_130_on_ctrl_c()\n"
            "import os, signal, time\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
  done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        text=True, timeout=60, preexec_fn=runs.sigint_at_its_default)
  _interrupted_in_one_line(done.returncode, done.stdout + done.stderr,
                           "interrupted; nothing was written")


def test_a_ctrl_c_that_library_code_swallowed_still_stops_training(smoke_config, tmp_path,
                                                                  monkeypatch):
  """A KeyboardInterrupt raised where Python can only print it (a __del__, a callback from C)
  or caught by library code is remembered: training does not start."""
  from transformer_jax import errors
  from transformer_jax.training import trainer
  from transformer_jax.data import pipeline
  prepare = pipeline.prepare

  def swallowing(*args, **kwargs):
    try:
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)  # The handler runs here.
    except KeyboardInterrupt:
      pass  # As code that catches everything does.
    return prepare(*args, **kwargs)

  monkeypatch.setattr(pipeline, "prepare", swallowing)
  previous = signal.getsignal(signal.SIGINT)
  # As from a terminal: this process may have started with SIGINT ignored (a background test
  # run), which note_interrupts leaves so.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  errors.note_interrupts()
  try:
    with pytest.raises(KeyboardInterrupt):
      trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  finally:
    signal.signal(signal.SIGINT, previous)
    errors._interrupted.clear()
  assert not (tmp_path / "w" / "checkpoints").exists()


def test_a_workdir_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
  # /sys takes no new file, not even from root (the tests may run as root, who passes chmod).
  result = _run("train.py", "--config", "configs/fra_eng.py:smoke", "--workdir",
                "/sys/transformer_jax_run", f"--config.data.data_dir={DATA / 'fra-eng'}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}")
  assert _one_error_line(result) == (
      "error: --workdir /sys/transformer_jax_run cannot be written: Permission denied (in /sys)")
  assert not (tmp_path / "tfds").exists()  # Refused before the dataset is prepared.
  file = tmp_path / "file"
  file.write_text("x")
  result = _run("train.py", "--config", "configs/fra_eng.py:smoke", "--workdir",
                str(file / "run"), f"--config.data.data_dir={DATA / 'fra-eng'}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}")
  assert _one_error_line(result) == (
      f"error: --workdir {file / 'run'} cannot be created: {file} is a file")


def test_an_output_that_cannot_be_written_is_refused_before_translating(trained):
  _, workdir = trained
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "Go.",
                "--output", "/sys/transformer_jax_out.txt")
  assert _one_error_line(result) == ("error: --output /sys/transformer_jax_out.txt cannot be "
                                     "written: Permission denied (in /sys)")


def _tsv_dir(path: Path, lines: list[str]) -> Path:
  path.mkdir(parents=True)
  for split in ("train", "validation"):
    (path / f"{split}.tsv").write_text("".join(line + "\n" for line in lines))
  return path


def test_another_corpus_in_the_same_tfds_dir_is_prepared_anew(tmp_path):
  from transformer_jax.data import sources
  first = _tsv_dir(tmp_path / "a", [f"hello {i}\tbonjour {i}" for i in range(50)])
  second = _tsv_dir(tmp_path / "b", [f"cat {i}\tchat {i}" for i in range(50)])
  tfds_dir = str(tmp_path / "tfds")
  pairs = lambda data: sorted(sources.pairs(
      sources.prepare("parallel_tsv", tfds_dir, str(data)), "parallel_tsv", "train"))
  assert pairs(first)[0] == ("hello 0", "bonjour 0")
  assert pairs(second)[0] == ("cat 0", "chat 0")  # Not the corpus prepared before.
  assert pairs(first)[0] == ("hello 0", "bonjour 0")  # Each stays prepared, under its key.
  assert sources.source_key(str(first)) != sources.source_key(str(second))


def test_a_tfds_dir_inside_the_corpus_is_not_part_of_it(tmp_path):
  """What preparing writes inside data_dir (the tfds dir, the token cache) does not change the
  corpus's key: a second process finds the dataset prepared by the first."""
  from transformer_jax.data import sources
  data = _tsv_dir(tmp_path / "corpus", [f"hello {i}\tbonjour {i}" for i in range(50)])
  tfds_dir = data / "tfds"
  script = ("import sys; from transformer_jax.data import sources; "
            "b = sources.prepare('parallel_tsv', sys.argv[1], sys.argv[2], sys.argv[3]); "
            "print(b.data_dir)")
  outputs = [subprocess.run([sys.executable, "-c", script, str(tfds_dir), str(data),
                             str(data / "cache")], capture_output=True, text=True,
                            check=True).stdout for _ in range(2)]
  prepared = [out.splitlines()[-1] for out in outputs]
  assert prepared[0] == prepared[1]
  assert "preparing" in outputs[0] and "preparing" not in outputs[1]  # Built once.
  assert [p.name for p in tfds_dir.iterdir()] == [Path(prepared[0]).parents[1].name]
  (data / "cache" / "tokens.bin").parent.mkdir()
  (data / "cache" / "tokens.bin").write_bytes(b"x")
  assert sources.source_key(str(data), (str(tfds_dir), str(data / "cache"))) == \
      Path(prepared[0]).parents[1].name
  (data / "more.txt").write_text("another file of the corpus")
  assert sources.source_key(str(data), (str(tfds_dir),)) != Path(prepared[0]).parents[1].name


def test_the_shared_tokenizer_is_keyed_by_the_split_it_is_fitted_on(smoke_config, tmp_path):
  data = _tsv_dir(tmp_path / "data", [f"sentence number {i} here\tphrase numéro {i} ici"
                                      for i in range(400)])
  smoke_config.data.update(dataset="parallel_tsv", data_dir=str(data),
                           tfds_dir=str(tmp_path / "t"), vocab_size=100, num_workers="0")
  for split in ("train[:40]", "train"):
    smoke_config.data.train_split = split
    cfg = config_lib.parse(smoke_config).data
    pipeline.prepare(cfg, tmp_path / split)
  # One tokenizer each, not the first one reused for the full split.
  assert len(list(pipeline.cache_root(cfg).glob("tokenizer-*"))) == 2
  assert (tmp_path / "train[:40]" / "tokenizer.model").read_bytes() != (
      tmp_path / "train" / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("config,message", [
    ("configs/fra_eng.py:Smoke",
     "error: --config=configs/fra_eng.py:Smoke: unknown config variant 'Smoke'; this config "
     "knows 'smoke'"),
    ("configs/multi30k.py:en-de",
     "error: --config=configs/multi30k.py:en-de: unknown config variant 'en-de'; this config "
     "knows 'de', 'smoke'"),
    ("config/fra_eng.py", "error: --config config/fra_eng.py: config/fra_eng.py is not a file"),
])
def test_an_unknown_config_variant_or_file_is_one_line(tmp_path, config, message):
  flag = ["--config", config] if config.startswith("config/") else [f"--config={config}"]
  result = _run("train.py", *flag, "--workdir", str(tmp_path / "w"))
  assert _one_error_line(result).startswith(message)
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("seed", [-1, 2 ** 63])
def test_a_seed_out_of_range_is_one_line_and_no_workdir(tmp_path, seed):
  result = _run("train.py", "--config", "configs/fra_eng.py:smoke", "--workdir",
                str(tmp_path / "w"), f"--config.data.data_dir={DATA / 'fra-eng'}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}", f"--config.run.seed={seed}")
  assert _one_error_line(result) == f"error: run.seed={seed} must be in [0, 2**63)"
  assert not (tmp_path / "w").exists() and not (tmp_path / "tfds").exists()


def test_a_parallel_tsv_line_with_a_third_column_is_named(smoke_config, tmp_path):
  from transformer_jax.data.builders import DatasetError
  data = _tsv_dir(tmp_path / "data", ["one\tun", "two\tdeux\textra", "three\ttrois"])
  smoke_config.data.update(dataset="parallel_tsv", data_dir=str(data),
                           tfds_dir=str(tmp_path / "t"), train_split="train",
                           eval_split="validation")
  with pytest.raises(DatasetError, match=r"train.tsv line 2 has 3 tab-separated fields; each "
                     r"line is 'source<TAB>target'"):
    trainer.train_and_evaluate(smoke_config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("flags,message", [
    (["--input", "{src}", "--output", "{src}"],
     "error: --output {src} is the --input file: it would be overwritten by the translations"),
    (["--input", "{src}", "--reference", "{ref}", "--output", "{ref}"],
     "error: --output {ref} is the --reference file: it would be overwritten by the "
     "translations"),
    (["--alpha", "-0.5", "Go."], "error: --alpha must be >= 0 (0: no length penalty), got -0.5"),
])
def test_translate_refuses_to_overwrite_its_input_and_a_negative_alpha(tmp_path, flags, message):
  src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
  src.write_text("Go.\n")
  ref.write_text("Va !\n")
  fill = lambda s: s.format(src=src, ref=ref)
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(tmp_path / "w"),
                *map(fill, flags))
  assert _one_error_line(result) == fill(message)
  assert src.read_text() == "Go.\n" and ref.read_text() == "Va !\n"


@pytest.mark.parametrize("where", ["a directory", "a missing directory"])
def test_aot_checks_its_json_before_compiling(tmp_path, where):
  """A report that cannot be written is refused first, not after every program compiled."""
  (tmp_path / "kept.txt").write_text("a user's file")
  json_path = tmp_path if where == "a directory" else tmp_path / "missing" / "r.json"
  result = _run("-m", "transformer_jax", "aot", "--config", "configs/fra_eng.py:smoke",
                "--topology", "cpu:1", "--json", str(json_path), timeout=120)
  line = _one_error_line(result)
  assert line == (f"error: --json {tmp_path} is a directory; name a file"
                  if where == "a directory" else
                  f"error: --json {json_path}: directory {json_path.parent} does not exist")
  assert _tree_digest(tmp_path) == {
      "kept.txt": hashlib.sha256(b"a user's file").hexdigest()}


def test_visualize_never_replaces_a_users_maps(trained, tmp_path):
  """--out holding a file of a map's name (KIND_layerN.png) is refused before any work."""
  out = tmp_path / "maps"
  out.mkdir()
  (out / "cross_layer1.png").write_bytes(b"a user's picture")
  (out / "notes.txt").write_text("kept")
  before = _tree_digest(out)
  result = _run("-m", "transformer_jax", "visualize", "--workdir", str(trained[1]), "--out",
                str(out), "I lost.")
  assert _one_error_line(result) == (f"error: --out {out} already holds cross_layer1.png: name "
                                     "a new directory, or move those away")
  assert _tree_digest(out) == before


def test_an_empty_data_dir_is_one_line_not_a_download(tmp_path):
  """tfds takes an empty manual directory for none given and would download instead."""
  (tmp_path / "data").mkdir()
  result = _run("train.py", "--config", "configs/fra_eng.py:smoke", "--workdir",
                str(tmp_path / "run"), f"--config.data.data_dir={tmp_path / 'data'}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}", timeout=120)
  assert _one_error_line(result) == (
      f"error: data.data_dir='{tmp_path / 'data'}' holds no file: put the corpus's raw files "
      "there (python -m transformer_jax download --out DIR), or leave data_dir empty to download "
      "them")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # Nothing written.


def test_translate_reads_standard_input_given_as_a_dash(trained):
  """`--input -` reads the sources from standard input, as Unix tools do."""
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "translate", "--workdir",
                           str(trained[1]), "--input", "-"], cwd=ROOT, input="I lost.\n\nGo.\n",
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 3 and lines[1] == ""  # An empty line translates to an empty line.
  alone = subprocess.run([sys.executable, "-m", "transformer_jax", "translate", "--workdir",
                          str(trained[1]), "I lost.", "Go."], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
  assert alone.stdout.splitlines() == [lines[0], lines[2]]


def test_a_vocab_size_below_what_the_corpus_needs_is_one_line(tmp_path, cache_dir):
  """SentencePiece needs a piece for each character (and, lossless, each byte): a smaller
  data.vocab_size is one line naming the least that works, and no run."""
  workdir = tmp_path / "w"
  result = subprocess.run(runs.shakespeare_command(
      "lm_shakespeare", workdir, tmp_path / "tfds", cache_dir, "--config.data.vocab_size=100"),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  needed = re.fullmatch(r"error: data.vocab_size=100 is below the (\d+) pieces this corpus "
                        r"needs \(each of its characters, the 256 bytes and the reserved ids\): "
                        r"raise it past (\d+) \(SentencePiece's count; a larger vocabulary may "
                        r"need a few more\)", last)
  assert needed and needed[1] == needed[2] and int(needed[1]) > 256, last
  assert not (workdir / "checkpoints").exists()
  again = subprocess.run(runs.shakespeare_command(
      "lm_shakespeare", workdir, tmp_path / "tfds", cache_dir,
      f"--config.data.vocab_size={int(needed[1]) + 32}", "--config.run.num_steps=2"),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]


def test_train_py_without_a_config_resumes_only_a_run(tmp_path):
  result = _run("train.py", "--workdir", str(tmp_path / "new"))
  assert _one_error_line(result) == (f"error: {tmp_path / 'new'} holds no config.json of a run "
                                     "to resume: a new run needs --config")
  assert not (tmp_path / "new").exists()
  assert _one_error_line(_run("train.py")) == (
      "error: --workdir is required (and --config, for a new run)")
  # An override without --config: absl's "Unknown command line flag" before.
  result = _run("train.py", "--workdir", str(tmp_path / "new"), "--config.run.num_steps=5")
  assert _one_error_line(result) == (
      "error: --config.run.num_steps: a config override needs --config (a run resumed with "
      "--workdir alone takes its config.json whole): give the recipe's config file with the "
      "override, e.g. --config configs/fra_eng.py")
