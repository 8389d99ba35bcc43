"""The package's shape: role folders over a small root of shared plumbing, imports only downward
and in no cycle, config.py imports no subsystem, a workdir's layout spelled in one module."""

import pytest
import ast
from pathlib import Path

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "transformer_jax"


def _module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
  """The package's modules that `path` imports, at the top or inside a function."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    found |= {n for n in names if n in modules}
  return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of the graph, or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_the_package_has_no_import_cycle():
  modules = _modules()
  graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
  assert len(graph) > 20 and graph["transformer_jax.training.trainer"]  # The graph was read.
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# The package's layers, lowest first: a module imports from its own layer or a lower one only.
# The root holds shared plumbing (config, checkpoint, programs, errors, fs, sharding, metrics);
# a run's files (its workdir, with the tokenizer, and opening it) sit above data and models and
# below all that uses a run; training sits above decoding, as it evaluates BLEU and compiles
# translate's decoder, and above interop, as a run may start from a Hugging Face checkpoint.
LAYERS = ("root", "data", "models", "runs", "decoding", "interop", "training", "serving",
          "commands")


def _layer(module: str) -> int:
  parts = module.split(".")
  folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) \
      else "root"
  return LAYERS.index(folder)


def test_nothing_imports_upward():
  modules = _modules()
  folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
  assert folders == set(LAYERS) - {"root"}  # Every folder has its layer.
  upward = sorted((name, imported) for name, path in modules.items() if name != "transformer_jax"
                  for imported in _imports(path, modules)
                  if imported != "transformer_jax" and _layer(imported) > _layer(name))
  assert upward == []


def test_the_root_holds_only_shared_plumbing():
  assert sorted(p.name for p in PACKAGE.glob("*.py")) == [
      "__init__.py", "__main__.py", "checkpoint.py", "config.py", "errors.py", "fs.py",
      "metrics.py", "programs.py", "sharding.py", "starting.py"]


def test_the_cycle_finder_finds_one():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_config_imports_no_subsystem():
  modules = _modules()
  assert _imports(PACKAGE / "config.py", modules) == {"transformer_jax.errors"}


def test_every_workdir_path_is_spelled_in_workdir_py():
  """The names of a workdir's config file and checkpoint directory appear as string constants
  in workdir.py and nowhere else in the package or train.py (messages name them through it),
  but for the Hugging Face format's own config.json."""
  spelled = {}
  for path in [*PACKAGE.rglob("*.py"), ROOT / "train.py"]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value in ("config.json", "checkpoints",
                                                          "config.json.tmp", "jax_cache"):
        spelled.setdefault(node.value, set()).add(path.relative_to(ROOT).as_posix())
  # The Hugging Face export writes that format's own config.json, not a workdir's.
  assert spelled == {"config.json": {"transformer_jax/runs/workdir.py",
                                     "transformer_jax/interop/huggingface.py"},
                     "checkpoints": {"transformer_jax/runs/workdir.py"},
                     "jax_cache": {"transformer_jax/runs/workdir.py"}}


def test_every_error_a_user_can_fix_derives_from_one_base():
  """Each module's error class for bad input is a UserError: commands report them all alike."""
  import importlib
  from transformer_jax.errors import UserError
  names = {"transformer_jax.config": "ConfigError", "transformer_jax.runs.workdir": "WorkdirError",
           "transformer_jax.decoding.options": "InferenceError",
           "transformer_jax.commands.report": "ReportError",
           "transformer_jax.training.average": "AverageError",
           "transformer_jax.training.targets": "AotError",
           "transformer_jax.interop.export": "ExportError",
           "transformer_jax.training.finetune": "InitFromError",
           "transformer_jax.commands.serve": "ServeError",
           "transformer_jax.training.steps": "NonFiniteError",
           "transformer_jax.fs": "NotWritableError",
           "transformer_jax.checkpoint": "CheckpointDamagedError",
           "transformer_jax.data.tokenizer": "TokenizerError",
           "transformer_jax.interop.huggingface": "CheckpointError",
           "transformer_jax.data.packing": "NoPairsError",
           "transformer_jax.data.documents": "NoDocumentsError",
           "transformer_jax.data.pipeline": "LabelsError",
           "transformer_jax.data.builders": "DatasetError",
           "transformer_jax.data.download": "DownloadError",
           "transformer_jax.training.goodput": "LedgerError"}
  for module, name in names.items():
    assert issubclass(getattr(importlib.import_module(module), name), UserError), name
  declared = set()  # Every exception class the package declares is one of them.
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
        declared.add(node.name)
  assert declared == set(names.values()) | {"UserError", "CheckpointNotFoundError",
                                            "CheckpointMismatchError", "CheckpointWriteError"}


@pytest.mark.quick
def test_the_code_has_a_licence_that_the_package_declares():
  import tomllib
  root = Path(__file__).resolve().parents[2]
  assert (root / "LICENSE").read_text().startswith("MIT License\n")
  project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
  assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
