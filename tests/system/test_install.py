"""The package as a developer installs it: `pip install -e .`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import DATA, ROOT


def _site_without_this_package(directory: Path) -> Path:
  """This environment's site-packages as links, less the installed copy of this package."""
  directory.mkdir()
  for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
    if not entry.name.lower().startswith(("transformer_jax", "__editable__")):
      (directory / entry.name).symlink_to(entry)
  return directory


def _requirement_closure(requirements: list[str]) -> list[metadata.Distribution]:
  """The distributions of this environment that pip would install for `requirements` (the
  requirements of a package's metadata, markers and extras evaluated), each checked to satisfy
  every specifier that asks for it."""
  found: dict[str, metadata.Distribution] = {}
  expanded: dict[str, set[str]] = {}  # The extras whose requirements are in `todo` already.
  todo = [(Requirement(r), "") for r in requirements]
  while todo:
    requirement, extra = todo.pop()
    if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
      continue
    name = canonicalize_name(requirement.name)
    dist = found.get(name) or metadata.distribution(name)
    assert requirement.specifier.contains(dist.version, prereleases=True), (requirement, dist.version)
    if name not in found:
      found[name] = dist
      todo += [(Requirement(r), "") for r in dist.requires or ()]
    for wanted in requirement.extras - expanded.get(name, set()):  # An extra's own too.
      expanded.setdefault(name, set()).add(wanted)
      todo += [(Requirement(r), wanted) for r in dist.requires or () if "extra" in r]
  return list(found.values())


def _site_of(distributions: list[metadata.Distribution], directory: Path) -> Path:
  """`directory` holding links to the files of `distributions` alone (each one's top-level
  packages, modules and metadata), as pip would have installed them."""
  directory.mkdir()
  for dist in distributions:
    site = Path(dist.locate_file(""))
    for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
      if not (directory / top).exists() and (site / top).exists():
        (directory / top).symlink_to(site / top)
  return directory


def _source_copy(tmp_path: Path) -> Path:
  """The package's installable files, copied into tmp_path/source."""
  source = tmp_path / "source"
  source.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, source)
  shutil.copytree(ROOT / "transformer_jax", source / "transformer_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  return source


def test_an_editable_install_runs_the_dataset_builders(tmp_path):
  """tfds reads a builder's directory through importlib.resources: on a namespace package an
  editable install's path holds setuptools' finder entry, and every builder failed with
  "MultiplexedPath only supports directories"."""
  source = _source_copy(tmp_path)  # An editable install writes its metadata beside it.
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; "
                         "print(sysconfig.get_paths()['purelib'])"], check=True,
                        capture_output=True, text=True).stdout.strip()
  dependencies = _site_without_this_package(tmp_path / "site")
  (Path(site) / "zz_dependencies.pth").write_text(f"{dependencies}\n")
  install = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps",
                            "-e", str(source)], capture_output=True, text=True, timeout=600)
  assert install.returncode == 0, install.stderr[-2000:]
  script = ("import transformer_jax\n"
            "from transformer_jax.data import builders\n"
            f"builder = builders.FraEng(data_dir={str(tmp_path / 'tfds')!r})\n"
            "print(transformer_jax.__file__)\n"
            "print(builder.info.name, sorted(builder.info.features))\n")
  run = subprocess.run([venv / "bin" / "python", "-c", script], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.splitlines() == [str(source / "transformer_jax" / "__init__.py"),
                                     "fra_eng ['en', 'fr']"]


def test_a_plain_install_runs_every_command_that_needs_no_extra(tmp_path, trained, tfds_dir):
  """`pip install .` with no extra into a fresh venv (no TensorFlow, CTranslate2 or Starlette to
  bring a package in unseen): each command's smallest real use on the smoke run; the commands
  that need an extra say which in one line. A dependency the package uses but does not declare
  fails here (jax.export's serialization needs flatbuffers, which jax does not declare). The
  venv sees only the distributions the built package's metadata requires, transitively, linked
  from this environment (what pip would install, without unpacking them again: a minute)."""
  source = _source_copy(tmp_path)  # pip builds beside its source.
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  python = str(venv / "bin" / "python")
  install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(source)],
                           capture_output=True, text=True, timeout=900)
  assert install.returncode == 0, install.stderr[-2000:]
  declared = json.loads(subprocess.run(
      [python, "-c", "import json, importlib.metadata as m; "
       "print(json.dumps(m.requires('transformer_jax')))"],
      check=True, capture_output=True, text=True).stdout)
  assert "flatbuffers>=24" in declared  # What the built wheel declares, not the source tree.
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        check=True, capture_output=True, text=True).stdout.strip()
  dependencies = _site_of(_requirement_closure(declared), tmp_path / "site")
  (Path(site) / "zz_dependencies.pth").write_text(f"{dependencies}\n")
  for extra in ("tensorflow", "ctranslate2", "starlette"):  # Truly without the extras.
    assert subprocess.run([python, "-c", f"import {extra}"], capture_output=True).returncode == 1
  run_dir = tmp_path / "run"
  shutil.copytree(trained[1], run_dir)

  def command(*args):
    return subprocess.run([python, "-m", "transformer_jax", *map(str, args)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)

  def ok(*args):
    result = command(*args)
    assert result.returncode == 0, (args, result.stderr[-3000:])
    return result

  ok("train", "--config", ROOT / "configs" / "fra_eng.py:smoke", "--workdir", tmp_path / "fresh",
     f"--config.data.data_dir={DATA / 'fra-eng'}", f"--config.data.tfds_dir={tfds_dir}",
     "--config.run.num_steps=2", "--config.eval.bleu_sentences=0")
  assert (tmp_path / "fresh" / "checkpoints" / "2").is_dir()
  assert len(ok("translate", "--workdir", run_dir, "I lost.", "Go.").stdout.splitlines()) == 2
  ok("export", "--workdir", run_dir, "--to", "jax", tmp_path / "exported")
  assert (tmp_path / "exported" / "export.json").is_file()
  ok("average", "--workdir", run_dir, "--last", "2", "--output", tmp_path / "averaged")
  assert (tmp_path / "averaged" / "checkpoints").is_dir()
  ok("visualize", "--workdir", run_dir, "--out", tmp_path / "maps", "I lost.")
  assert (tmp_path / "maps" / "cross_layer1.png").is_file()
  ok("download", "--out", tmp_path / "data", "--sets", "fra-eng", "--mirror", DATA / "fra-eng")
  assert (tmp_path / "data" / "fra-eng" / "fra-eng.zip").is_file()
  # An extra's command: one line naming the extra, nothing written.
  for args, extra in ((("serve", "--workdir", run_dir, "--port", "0"), "serve"),
                      (("export", "--workdir", run_dir, "--to", "ctranslate2",
                        tmp_path / "ct2"), "export")):
    result = command(*args)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"pip install '.[{extra}]'" in last, last
  assert not (tmp_path / "ct2").exists()
