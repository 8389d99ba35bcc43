"""Nothing a user owns is deleted or overwritten: each command that would is refused with one
line before any work, and every file that existed before is byte for byte as it was."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.system.test_user_mistakes import (_one_error_line, _run, _train_args, _tree_digest,
                                      _with_another_tokenizer)


@pytest.fixture
def run_copy(trained, tmp_path):
  """A copy of the smoke run, named `run.tmp`: what export and average once used as their
  scratch directory for an output named `run`."""
  workdir = tmp_path / "run.tmp"
  shutil.copytree(trained[1], workdir)
  return workdir


def test_export_next_to_a_workdir_named_like_its_scratch_space_keeps_it(run_copy):
  before = _tree_digest(run_copy)
  out = run_copy.parent / "run"
  result = _run("-m", "transformer_jax", "export", "--workdir", str(run_copy), "--to",
                "ctranslate2", str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  assert _tree_digest(run_copy) == before
  assert (out / "model.bin").is_file()
  assert not list(run_copy.parent.glob(".run.partial-*"))  # Its own scratch space is gone.


def test_average_next_to_a_workdir_named_like_its_scratch_space_keeps_it(run_copy):
  before = _tree_digest(run_copy)
  out = run_copy.parent / "run"
  result = _run("-m", "transformer_jax", "average", "--workdir", str(run_copy), "--last", "2",
                "--output", str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  assert _tree_digest(run_copy) == before
  assert (out / "checkpoints").is_dir()
  assert not list(run_copy.parent.glob(".run.partial-*"))


@pytest.mark.parametrize("files,message", [
    # A CTranslate2 export: its own config.json, which train.py once replaced.
    ({"config.json": json.dumps({"add_source_bos": False, "bos_token": "<s>",
                                 "layer_norm_epsilon": 1e-6}), "model.bin": "weights"},
     "is not a training run's config (it names none of the config's sections or fields)"),
    ({"notes.txt": "mine", "data.csv": "1,2"},
     "is not a training workdir (it holds data.csv, notes.txt and no config.json)"),
])
def test_train_refuses_a_directory_that_is_not_a_run(trained, tmp_path, files, message):
  config, _ = trained
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  for name, text in files.items():
    (foreign / name).write_text(text)
  before = _tree_digest(foreign)
  result = _run(*_train_args(config, foreign))
  assert message in _one_error_line(result)
  assert _tree_digest(foreign) == before


def test_train_refuses_a_hugging_face_model_folder(trained, tmp_path):
  """Its config.json shares field names with ours (vocab_size): train.py once trained into it
  and replaced that file, which `from_pretrained` then could not read. GPT-2's through
  train.py; BERT's and Marian's by the same check in this process."""
  import transformers
  from transformer_jax.runs.workdir import Workdir, WorkdirError
  for other in ("BertConfig", "MarianConfig"):
    getattr(transformers, other)(vocab_size=1000).save_pretrained(tmp_path / other)
    with pytest.raises(WorkdirError, match="it is a Hugging Face model's config, model_type"):
      Workdir(tmp_path / other).check_is_a_run()
  kind = "GPT2Config"
  config, _ = trained
  folder = tmp_path / "hf"
  getattr(transformers, kind)(vocab_size=1000).save_pretrained(folder)
  (folder / "model.safetensors").write_bytes(b"weights")
  before = _tree_digest(folder)
  result = _run(*_train_args(config, folder))
  model_type = json.loads((folder / "config.json").read_text())["model_type"]
  assert _one_error_line(result) == (
      f"error: {folder / 'config.json'} is not a training run's config (it is a Hugging Face "
      f"model's config, model_type {model_type!r}): {folder} is not a training workdir")
  assert _tree_digest(folder) == before
  assert getattr(transformers, kind).from_pretrained(folder).vocab_size == 1000


@pytest.mark.parametrize("inside", ["config.json", "tokenizer.model", "checkpoints/out.txt",
                                    "new.txt"])
def test_translate_output_inside_the_workdir_is_refused(run_copy, inside):
  before = _tree_digest(run_copy)
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(run_copy), "--output",
                str(run_copy / inside), "Hello.")
  assert _one_error_line(result) == (
      f"error: --output {run_copy / inside} is inside the workdir {run_copy}: name a file "
      "outside it (its files are the run's)")
  assert _tree_digest(run_copy) == before


def test_a_tokenizer_of_the_same_size_is_caught_by_its_identity(trained, tmp_path):
  """Fitted on another sample, it has as many pieces: the embedding shapes agree, and only the
  tokenizer's identity saved with each checkpoint tells them apart."""
  from transformer_jax.data.tokenizer import Tokenizers
  config, source = trained
  workdir, other = _with_another_tokenizer(trained, tmp_path, tokenizer_sample=1500)
  theirs, ours = Tokenizers.load(other), Tokenizers.load(source)
  assert theirs.src.vocab_size == ours.src.vocab_size and theirs.digest() != ours.digest()
  before = _tree_digest(workdir)

  expected = (f"error: the checkpoint of step 20 in {workdir / 'checkpoints'} is intact but was "
              "trained with another tokenizer")
  assert _one_error_line(_run(*_train_args(config, workdir, num_steps=30))).startswith(expected)
  translate = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "Go.")
  assert _one_error_line(translate).startswith(expected)
  assert _tree_digest(workdir) == before
  # With its own tokenizer back, the run goes on.
  shutil.copy(source / "tokenizer.model", workdir / "tokenizer.model")
  result = _run("-m", "transformer_jax", "translate", "--workdir", str(workdir), "Go.")
  assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("args,message", [
    (["--to", "ctranslate2", "{w}/checkpoints/30"],
     "error: {w}/checkpoints/30 is inside the workdir {w}: name a directory outside it (its "
     "files are the run's)"),
    (["--to", "jax", "--alpha", "-1", "{out}"],
     "error: --alpha must be >= 0 (0: no length penalty), got -1.0"),
])
def test_export_refuses_an_output_inside_the_workdir_and_a_negative_alpha(run_copy, args,
                                                                          message):
  out = run_copy.parent / "exported"
  fill = lambda text: text.format(w=run_copy, out=out)
  before = _tree_digest(run_copy)
  result = _run("-m", "transformer_jax", "export", "--workdir", str(run_copy),
                *map(fill, args))
  assert _one_error_line(result) == fill(message)
  assert _tree_digest(run_copy) == before and not out.exists()


def test_a_disk_that_fills_at_a_checkpoint_is_one_line(trained, tmp_path):
  """train.py on a 1.5 MB file system of its own (a tmpfs in a private mount namespace): the
  checkpoint that does not fit ends the run with one line, no traceback from orbax's writers."""
  import shlex
  import subprocess
  import sys
  from tests.conftest import ROOT
  config, _ = trained
  small = tmp_path / "small"
  small.mkdir()
  train = " ".join(shlex.quote(a) for a in [sys.executable, *_train_args(config, small / "w")])
  result = subprocess.run(
      ["unshare", "--map-root-user", "--mount", "sh", "-c",
       f"mount -t tmpfs -o size=1500k tmpfs {shlex.quote(str(small))} && exec {train}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  line = _one_error_line(result)
  assert line.startswith(f"error: a checkpoint could not be written to {small / 'w'}/checkpoints: "
                         "no space left on device. The checkpoints before it are intact"), line
  assert "Exception ignored" not in result.stderr


def test_ctrl_c_during_export_exits_130_and_writes_nothing(run_copy):
  """SIGINT once the checkpoint is read, while the decoders are exported: exit 130, no output
  and no scratch directory, whatever part of the export it lands in."""
  import os
  import signal
  import subprocess
  import sys
  from tests import runs
  from tests.conftest import ROOT
  out = run_copy.parent / "exported"
  process = subprocess.Popen(
      [sys.executable, "-m", "transformer_jax", "export", "--workdir", str(run_copy), "--to",
       "jax", str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS="cpu"), preexec_fn=runs.sigint_at_its_default)
  seen = []
  for line in process.stderr:
    seen.append(line)
    if "Restored step" in line:
      process.send_signal(signal.SIGINT)
      break
  rest = process.stderr.read()
  assert process.wait(timeout=300) == 130, "".join(seen)[-2000:] + rest[-2000:]
  assert rest.strip().splitlines()[-1] == "error: interrupted; nothing was written"
  assert not out.exists() and not list(run_copy.parent.glob(".exported.partial-*"))


def test_a_directory_of_hidden_files_or_a_stopped_runs_files_is_a_run(tmp_path):
  from transformer_jax.runs.workdir import Workdir, WorkdirError
  (tmp_path / ".DS_Store").write_text("finder")
  (tmp_path / "tokenizer.model").write_text("written before config.json")
  (tmp_path / "events.out.tfevents.1.host").write_text("")
  Workdir(tmp_path).check_is_a_run()  # Accepted.
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(WorkdirError, match="holds notes.txt and no config.json"):
    Workdir(tmp_path).check_is_a_run()


def test_translate_on_a_full_disk_leaves_the_file_it_would_replace_as_it_was(run_copy, tmp_path):
  """--output on a small file system of its own (a tmpfs in a private mount namespace) whose
  free space cannot hold the translations: one error line, and the file that was there keeps
  every byte. Written in place, it would have been emptied and cut."""
  import shlex
  import subprocess
  import sys
  from tests.conftest import ROOT
  small = tmp_path / "small"
  small.mkdir()
  lines = tmp_path / "in.txt"
  lines.write_text("".join(f"It is {n} o'clock and the train is late again.\n"
                           for n in range(400)))
  translate = " ".join(shlex.quote(a) for a in [
      sys.executable, "-m", "transformer_jax", "translate", "--workdir", str(run_copy),
      "--input", str(lines), "--output", str(small / "out.txt")])
  # 8 pages: the old output takes one, the filler six, and one is left for the new output.
  fill = (f"mount -t tmpfs -o size=32k tmpfs {shlex.quote(str(small))} && "
          f"printf 'mine\\n' > {shlex.quote(str(small / 'out.txt'))} && "
          f"head -c 24576 /dev/zero > {shlex.quote(str(small / 'filler'))} && "
          f"{translate}; status=$?; cat {shlex.quote(str(small / 'out.txt'))} > "
          f"{shlex.quote(str(tmp_path / 'after.txt'))}; ls -a {shlex.quote(str(small))} > "
          f"{shlex.quote(str(tmp_path / 'listing.txt'))}; exit $status")
  result = subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c", fill],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  line = _one_error_line(result)
  assert "no space left on device" in line.lower(), line
  assert (tmp_path / "after.txt").read_text() == "mine\n"
  assert (tmp_path / "listing.txt").read_text().split() == [".", "..", "filler", "out.txt"]


@pytest.mark.parametrize("command", [("export", "--to", "huggingface"),
                                     ("average", "--last", "2", "--output")])
def test_what_export_and_average_write_follows_the_users_umask(trained, tmp_path, command):
  """Under umask 022 every folder they write is 0755 and every file 0644: another account
  (a server's) can load it (they once wrote folders 0700 and model.safetensors 0600)."""
  import subprocess
  import sys
  from tests.conftest import ROOT
  out = tmp_path / "out"
  args = [*command, str(out)]
  result = subprocess.run(
      [sys.executable, "-m", "transformer_jax", args[0], "--workdir", str(trained[1]),
       *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600,
      preexec_fn=lambda: os.umask(0o022))
  assert result.returncode == 0, result.stderr[-3000:]
  modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
           for p in [out, *out.rglob("*")]}
  assert len(modes) > 2
  assert {m for p, m in modes.items() if (tmp_path / p).is_dir()} == {"0o755"}, modes
  assert {m for p, m in modes.items() if (tmp_path / p).is_file()} == {"0o644"}, modes


@pytest.mark.parametrize("inside", ["metrics.jsonl", "config.json", "goodput.jsonl",
                                    "tokenizer.model", "checkpoints/curves.png"])
def test_report_png_over_a_runs_file_is_refused(run_copy, inside):
  """report once drew its PNG over the run's config.json or logs (exit 0), after which
  translate called the run damaged."""
  before = _tree_digest(run_copy)
  result = _run("-m", "transformer_jax", "report", "--workdir", str(run_copy), "--png",
                str(run_copy / inside))
  assert _one_error_line(result) == (
      f"error: --png {run_copy / inside} is inside the workdir {run_copy}: name a file "
      "outside it (its files are the run's)")
  assert _tree_digest(run_copy) == before


def test_report_draws_beside_the_runs_files_and_never_over_another_kind(run_copy, tmp_path):
  before = _tree_digest(run_copy)
  for _ in range(2):  # The default, then drawn again over its own PNG.
    result = _run("-m", "transformer_jax", "report", "--workdir", str(run_copy))
    assert result.returncode == 0, result.stderr[-3000:]
  drawn = (run_copy / "report.png").read_bytes()
  assert drawn.startswith(b"\x89PNG\r\n\x1a\n")
  assert _tree_digest(run_copy) == {**before, "report.png": _tree_digest(run_copy)["report.png"]}
  corpus = tmp_path / "fra-eng.zip"  # Anyone's file that is not a PNG: a corpus, notes.
  corpus.write_bytes(b"PK\x03\x04 a corpus")
  notes = tmp_path / "notes.txt"
  notes.write_text("mine")
  for path, kind in ((corpus, "PNG"), (notes, "PNG")):
    result = _run("-m", "transformer_jax", "report", "--workdir", str(run_copy), "--png",
                  str(path))
    assert _one_error_line(result) == (
        f"error: --png {path} exists and is not a {kind} file: it would be overwritten; name "
        "a new file")
  assert corpus.read_bytes() == b"PK\x03\x04 a corpus" and notes.read_text() == "mine"


def test_text_outputs_never_replace_a_binary_file_a_dataset_or_a_run(run_copy, tmp_path):
  """translate's, generate's, fill's and classify's --output share one check."""
  corpus = tmp_path / "fra-eng.zip"
  corpus.write_bytes(b"PK\x03\x04\x00\x00 a corpus")
  prepared = tmp_path / "tfds" / "fra_eng" / "1.0.0"
  prepared.mkdir(parents=True)
  (prepared / "dataset_info.json").write_text("{}")
  cases = [
      (["translate", "--workdir", str(run_copy), "--output", str(corpus), "Hello."],
       f"error: --output {corpus} exists and is not a text file: it would be overwritten; "
       "name a new file"),
      (["translate", "--workdir", str(run_copy), "--output", str(prepared / "out.txt"),
        "Hello."],
       f"error: --output {prepared / 'out.txt'} is inside the prepared dataset {prepared}: "
       "name a file outside it"),
      (["fill", "--workdir", str(run_copy), "--output", str(run_copy / "metrics.jsonl"),
        "a [MASK]"],
       f"error: --output {run_copy / 'metrics.jsonl'} is inside the workdir {run_copy}: name "
       "a file outside it (its files are the run's)"),
  ]
  before = _tree_digest(tmp_path)
  for args, message in cases:
    assert _one_error_line(_run("-m", "transformer_jax", *args)) == message
  assert _tree_digest(tmp_path) == before


@pytest.mark.parametrize("flag,inside,kind", [
    ("--json", "metrics.jsonl", "file"), ("--save_train_step", "checkpoints/step.bin", "file"),
    ("--hlo", "checkpoints/hlo", "directory")])
def test_aot_writes_nothing_into_a_run(run_copy, flag, inside, kind):
  before = _tree_digest(run_copy)
  result = _run("-m", "transformer_jax", "aot", "--config", "configs/fra_eng.py:smoke",
                "--topology", "v5e:2x2", flag, str(run_copy / inside))
  assert _one_error_line(result) == (
      f"error: {flag} {run_copy / inside} is inside the workdir {run_copy}: name a {kind} "
      "outside it (its files are the run's)")
  assert _tree_digest(run_copy) == before


def test_visualize_draws_beside_a_runs_files_not_among_them(run_copy):
  before = _tree_digest(run_copy)
  out = run_copy / "checkpoints" / "maps"
  result = _run("-m", "transformer_jax", "visualize", "--workdir", str(run_copy), "--out",
                str(out), "I lost.")
  assert _one_error_line(result) == (
      f"error: --out {out} is inside the workdir {run_copy}: name a directory outside it (its "
      "files are the run's)")
  assert _tree_digest(run_copy) == before
