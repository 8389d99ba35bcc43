"""The package as a developer installs it: `pip install -e .`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import ROOT


def _site_without_this_package(directory: Path) -> Path:
  """This environment's site-packages as links, less the installed copy of this package."""
  directory.mkdir()
  for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
    if not entry.name.lower().startswith(("transformer_jax", "__editable__")):
      (directory / entry.name).symlink_to(entry)
  return directory


def test_an_editable_install_runs_the_dataset_builders(tmp_path):
  """tfds reads a builder's directory through importlib.resources: on a namespace package an
  editable install's path holds setuptools' finder entry, and every builder failed with
  "MultiplexedPath only supports directories"."""
  source = tmp_path / "source"  # A copy: an editable install writes its metadata beside it.
  source.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, source)
  shutil.copytree(ROOT / "transformer_jax", source / "transformer_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
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
