"""The README and docs/: short where they should be, about the project only, and every command
in them one that runs as written."""

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# An absolute path of a machine, a working sitting, an issue number.
NOT_ABOUT_THE_PROJECT = re.compile(
    r"/(work|tmp|home|root|Users)/|\bsessions?\b|\bsittings?\b|\bissues? \d+|#\d+", re.I)


COMMAND = re.compile(r"(\.venv/bin/)?(python3?|pip)\s")  # An indented line that runs one.


def _lines(block: str) -> list[str]:
  """A block's lines, continuation lines joined and comments left out."""
  lines = (line.split("  #")[0].strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines())
  return [line for line in lines if line and not line.startswith("#")]


def documented_commands(text: str) -> list[str]:
  """The shell commands of a Markdown text: every line of its ```sh blocks, and the lines of
  its indented code blocks (four spaces, after a blank line) that start a Python command."""
  found = [line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in _lines(block)]
  unfenced = re.sub(r"```.*?```", "", text, flags=re.S)
  for block in re.findall(r"(?:^|\n\n)((?: {4}.*(?:\n|$))+)", unfenced):
    found += [line for line in _lines(textwrap.dedent(block)) if COMMAND.match(line)]
  return found


def _runnable(command: str) -> list[str] | None:
  """The command's argv with this test's Python, or None for one that is not this project's
  program (installs, launchers such as srun)."""
  argv = shlex.split(command)
  if argv[0] not in ("python", ".venv/bin/python") or argv[1:3] == ["-m", "pytest"]:
    return None
  # A template: configs/CONFIG.py, or a config given a path to fill in (configs/NAME.py:PATH).
  if re.search(r"configs/([A-Z]+\.py|\w+\.py:[A-Z]+\b)", command):
    return None
  return [sys.executable, *argv[1:]]


def table_commands(text: str) -> list[str]:
  """The commands with flags in a results table's backticks, as the Python commands they are:
  `benchmarks/X.py ...`, `train.py ...`, `aot ...` (python -m transformer_jax aot ...)."""
  found = []
  for span in re.findall(r"`([^`\n]+)`", text):
    name = span.split()[0]
    if "--" not in span:
      continue
    if name.startswith("benchmarks/") and name.endswith(".py") or name == "train.py":
      found.append(f"python {span}")
    elif (ROOT / "transformer_jax" / "commands" / f"{name}.py").is_file():
      found.append(f"python -m transformer_jax {span}")
  return found


ALL_COMMANDS = [(path.relative_to(ROOT).as_posix(), c)
                for path in DOCS for c in documented_commands(path.read_text())
                + (table_commands(path.read_text()) if path == ROOT / "docs" / "results.md" else [])]


@functools.cache
def _script_help(script: str) -> str:
  """A benchmark script's --help (argparse), once a run."""
  result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  return result.stdout


def _required_flags(argv: list[str]) -> list[str]:
  """The flags a command cannot run without: an argparse script's (its usage line's flags
  outside brackets), or what a command's module says `is required` / `are required`."""
  if argv[1].startswith("benchmarks/"):
    usage = _script_help(argv[1]).split("\n\n")[0]
    while re.search(r"\[[^\[\]]*\]", usage):
      usage = re.sub(r"\[[^\[\]]*\]", "", usage)
    return re.findall(r"--\w+", usage)
  name = _command_name(argv)
  if name == "aot" and {"--install_plugins", "--install_cudnn"} & set(argv):
    return []  # Installing the compilers needs no config.
  source = (ROOT / "transformer_jax" / "commands" / f"{name}.py").read_text()
  return [flag for said in re.findall(r"((?:--\w+(?:,| and) )*--\w+) (?:is|are) required", source)
          for flag in re.findall(r"--\w+", said)]


def _command_name(argv: list[str]) -> str:
  return "train" if argv[1] == "train.py" else argv[3]


def _flags_of(argv: list[str]) -> list[str]:
  """The command's own argv: its flags and arguments, after its program name."""
  return argv[2:] if argv[1] == "train.py" else argv[4:]


PARSED = [_runnable(c) for _, c in ALL_COMMANDS if _runnable(c)]


@functools.cache
def _parsed(name: str) -> tuple[list[str], dict[tuple[str, ...], str | None]]:
  """(the flags `name` defines, each documented argv of it -> its parse error or None), every
  documented command line of `name` parsed in one process (tests/parse_commands.py)."""
  argvs = [_flags_of(a) for a in PARSED
           if not a[1].startswith("benchmarks/") and _command_name(a) == name]
  result = subprocess.run([sys.executable, str(ROOT / "tests" / "parse_commands.py"), name],
                          input=json.dumps([[name, *a] for a in argvs]), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  answer = json.loads(result.stdout)
  return answer["flags"], dict(zip(map(tuple, argvs), answer["errors"]))


@pytest.mark.quick
def test_the_readme_is_for_users():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 150
  assert lines[0] == "# transformer_jax"
  for heading in ("## The two commands", "## Headline results", "## Commands", "## Layout"):
    assert heading in lines


RECORDS = ROOT / "docs" / "results.md"  # The one page of measurements.
RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.quick
@pytest.mark.parametrize("path", [p for p in DOCS if p != RECORDS],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_reference_is_short_and_names_no_commit(path):
  """A reference says how to use one part: at most 300 lines, no commit hashes (the records,
  with what was run at which version, are docs/results.md and the JSON it links)."""
  lines = path.read_text().splitlines()
  assert len(lines) <= 300
  assert not _lines_matching(path, re.compile(r"\b[0-9a-f]{7,40}\b")), "a commit-like hash"


def _cited_results() -> set[str]:
  cited = set()
  for path in DOCS:
    cited |= set(re.findall(r"benchmarks/results/[\w./-]*\w", path.read_text()))
  return cited


@pytest.mark.quick
def test_every_kept_result_is_cited_and_every_cited_one_kept():
  kept = {p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*") if p.is_file()}
  cited = _cited_results()
  assert len(kept) > 20
  assert sorted(kept - cited) == [], "kept, cited by no doc"
  assert sorted(c for c in cited if not (ROOT / c).exists()) == [], "cited, not kept"


@pytest.mark.quick
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_no_machine_paths_sittings_or_issues(path):
  bad = _lines_matching(path, NOT_ABOUT_THE_PROJECT)
  assert not bad, "\n".join(bad)


def _lines_matching(path, pattern) -> list[str]:
  return [f"{path.name}:{n}: {line.strip()}"
          for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


# A lab notebook's wording: when or how something happened to be run, not what it measured.
JOURNAL = re.compile(r"\blent (for|once)\b|available then|\bslow(er)? day\b|\b(to|yester)day\b|"
                     r"this morning|\bscratch\b(?! size)", re.I)


@pytest.mark.quick
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_read_as_records_not_a_journal(path):
  bad = _lines_matching(path, JOURNAL)
  assert not bad, "\n".join(bad)


@pytest.mark.quick
def test_the_journal_pattern_catches_what_it_should():
  for text in ("an H100 lent for one day", "the compute available then", "on a slow day",
               "five runs today", "a scratch timing", "In scratch checks"):
    assert JOURNAL.search(text), text
  assert not JOURNAL.search("XLA asks the CUDA runtime for its scratch size on 2026-11-22")


@pytest.mark.quick
def test_the_pattern_catches_what_it_should():
  for text in ("see /work/main/runs", "in the fifth session", "one sitting", "issue 12", "#12"):
    assert NOT_ABOUT_THE_PROJECT.search(text), text
  assert not NOT_ABOUT_THE_PROJECT.search("runs/fra_eng on 2026-11-23, 2-core CPU")


@pytest.mark.quick
def test_every_doc_links_and_commands_were_found():
  assert len(ALL_COMMANDS) > 25
  readme = (ROOT / "README.md").read_text()
  for link in re.findall(r"\]\(([^)#]+)\)", readme):
    assert (ROOT / link).exists(), link


@pytest.mark.quick
@pytest.mark.parametrize("where,command", [c for c in ALL_COMMANDS if _runnable(c[1])])
def test_every_documented_command_parses(where, command):
  """Each command's flags, config file, config variant and overrides are read as the command
  would read them (absl, with the command's own parser; argparse: each flag given is one the
  script knows), with nothing run."""
  argv = _runnable(command)
  given = {a.split("=")[0] for a in argv[2:] if a.startswith("--")}
  missing = [f for f in _required_flags(argv) if f not in given]
  assert not missing, f"{where}: {command} lacks {', '.join(missing)}"
  if argv[1].startswith("benchmarks/"):
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
      assert flag in _script_help(argv[1]), f"{where}: {flag} is not a flag of {argv[1]}"
    return
  defined, errors = _parsed(_command_name(argv))
  assert errors[tuple(_flags_of(argv))] is None, f"{where}: {errors[tuple(_flags_of(argv))]}"
  for flag in (a.split("=")[0][2:] for a in argv[2:] if a.startswith("--")):
    if not flag.startswith("config."):  # --noX is a boolean flag's.
      assert flag in defined or flag.startswith("no") and flag[2:] in defined, (
          f"{where}: no flag --{flag}")


@pytest.fixture(scope="module")
def workdir_as_documented(tmp_path_factory, trained):
  """A copy of the smoke run under the name the docs use, runs/fra_eng, in a scratch directory
  laid out like a clone (data at ../shared/data)."""
  scratch = tmp_path_factory.mktemp("clone")
  shutil.copytree(trained[1], scratch / "runs" / "fra_eng")
  return scratch


@pytest.mark.parametrize("command", sorted({  # A command two docs show runs once.
    c for _, c in ALL_COMMANDS if _runnable(c)
    and re.match(r"\S*python -m transformer_jax (translate|visualize|average) --workdir "
                 r"runs/fra_eng( \"[^\"]+\")* ?(--out \S+|--last 3 --output \S+)? ?(\"[^\"]+\"\s*)*$",
                 c)}))
def test_the_short_documented_commands_run_as_written(workdir_as_documented, command):
  """translate, visualize and average, exactly as documented, on a workdir named as in the docs
  (the smoke run's model)."""
  argv = _runnable(command)
  if "average" in argv:  # The smoke run kept 2 checkpoints, not 3; a new output each time.
    argv[argv.index("--last") + 1] = "2"
    shutil.rmtree(workdir_as_documented / argv[argv.index("--output") + 1], ignore_errors=True)
  if "visualize" in argv:  # It never replaces maps already there: a new directory each time.
    shutil.rmtree(workdir_as_documented / argv[argv.index("--out") + 1], ignore_errors=True)
  result = subprocess.run(argv, cwd=workdir_as_documented, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert result.returncode == 0, result.stderr[-2000:]
  if "translate" in argv:
    sentences = argv[argv.index("runs/fra_eng") + 1:]
    assert len(sentences) == 2 and len(result.stdout.strip().splitlines()) == 2
  if "visualize" in argv:
    assert (workdir_as_documented / "maps" / "cross_layer1.png").is_file()
  if "average" in argv:
    assert (workdir_as_documented / "runs" / "fra_eng_avg3" / "checkpoints").is_dir()


SECTION_FIELD = re.compile(r"`(?:--config\.)?(data|model|optimizer|step|eval|run|decode)\.([a-z]\w*)")


@pytest.mark.quick
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_only_config_fields_that_exist(path):
  """Every `SECTION.FIELD` a doc names in backticks is a field of the config, and no doc names
  a field by its name from before the config had sections (`eval_batch_size`)."""
  from transformer_jax import config
  fields = config.base_config()
  bad = []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    for section, field in SECTION_FIELD.findall(line):
      # (A file's name is no field; an example of the error a misspelled field gets.)
      if (field not in fields[section] and field not in ("py", "safetensors")
          and "misspelled" not in line):
        bad.append(f"{path.name}:{n}: {section}.{field}")
    bad += [f"{path.name}:{n}: {name} (now {config.moved(name)})"
            for name in re.findall(r"`(\w+)`", line) if name in config._FLAT_RENAMED]
  assert not bad, "\n".join(bad)


@pytest.mark.quick
def test_ci_runs_the_readmes_test_command_as_written():
  """`.ci/run` runs the second command of the README's "The two commands" (installs, fetches
  the data into data/, runs the tests), read from the README itself."""
  two = (ROOT / "README.md").read_text().split("## The two commands", 1)[1].split("\n## ", 1)[0]
  train, tests = re.findall(r"```sh\n(.*?)\n```", two, re.S)
  assert "train.py" in train and "download --out data" in train
  assert re.search(r"download --out data && \S+ -m pytest", tests), tests
  ci = (ROOT / ".ci" / "run").read_text()
  assert 'bash -c "$command"' in ci and "TRANSFORMER_JAX_MIRROR" in ci
  assert "TRANSFORMER_JAX_DATA" not in ci  # The tests read data/, where the command put it.
