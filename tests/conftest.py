"""Shared fixtures: the real corpora (in $TRANSFORMER_JAX_DATA, default data/, where
`python -m transformer_jax download --out data` puts them), prepared once per session with tfds."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The suite's programs run a few steps each and are timed by nothing: compiled without LLVM's
# optimizations, for this process and every command the tests start (the whole suite takes
# about a third less time; what the programs compute is the same to the tests' tolerances).
FAST_COMPILE = "--xla_backend_optimization_level=0"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{FAST_COMPILE} {os.environ.get('XLA_FLAGS', '')}".strip()


def xla_flags(*flags: str) -> str:
  """XLA_FLAGS for a process the tests start: the suite's own and `flags`."""
  return " ".join((os.environ["XLA_FLAGS"], *flags))


def optimized_env() -> dict[str, str]:
  """The environment for a process that trains for a hundred steps or more: its programs
  compiled with LLVM's optimizations (d2l_tiny's 120 steps: 39 s against 59 s without)."""
  flags = os.environ["XLA_FLAGS"].replace(FAST_COMPILE, "").strip()
  return dict(os.environ, XLA_FLAGS=flags)

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # train.py and configs/ live at the repository root.
DATA = Path(os.environ.get("TRANSFORMER_JAX_DATA", ROOT / "data")).resolve()


CACHE_ENV = "TRANSFORMER_JAX_TESTS_JAX_CACHE"


def pytest_configure(config):
  """One persistent compilation cache for the whole run, made by the first pytest process (the
  xdist workers it starts inherit its path), and used by the tests' own process from its first
  compilation on: a program that two workers, or a worker and a command the tests start,
  compile is compiled once a run. A path set beforehand is kept (and kept between runs)."""
  if hasattr(config.option, "loadscopereorder"):  # xdist's order by number of tests: off.
    config.option.loadscopereorder = False  # (LONGEST_FIRST, below.)
  if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="transformer_jax_tests_jax_cache_")
    config.stash[_MADE_CACHE] = True
  import jax
  jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# The test files that take longest (`.ci/run`'s durations on a 2-core CPU), longest first. xdist
# hands each worker whole files (--dist loadfile) in the collection's order, kept as it is
# below: the long files go out first and the last ones handed out are short, so the two workers
# end together (xdist's own order, by number of tests, left one idle for a minute at the end).
LONGEST_FIRST = ("test_slots.py", "test_run_gpu.py", "test_aot.py", "test_reliability.py",
                 "test_encoder_only.py", "test_multihost.py", "test_user_mistakes.py",
                 "test_translate.py", "test_serve.py", "test_benchmarks.py", "test_lm_training.py",
                 "test_owned_files.py", "test_translator.py", "test_fast_decoding.py",
                 "test_sharding.py", "test_model.py", "test_docs.py", "test_command_line.py",
                 "test_decode.py", "test_huggingface_import.py", "test_average.py",
                 "test_export.py", "test_completions.py", "test_step.py", "test_install.py",
                 "test_moved_run.py", "test_language_model.py", "test_train.py",
                 "test_no_tensorflow.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: a file's own order.


def pytest_terminal_summary(terminalreporter):
  """Each reason tests were skipped for, in one line that names them (with xdist too, where
  the workers' reports reach this process)."""
  by_reason: dict[str, list[str]] = {}
  for report in terminalreporter.stats.get("skipped", []):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    by_reason.setdefault(reason.removeprefix("Skipped: "), []).append(report.nodeid)
  for reason, tests in by_reason.items():
    terminalreporter.write_line(f"skipped {len(tests)} ({', '.join(tests)}): {reason}")


def pytest_unconfigure(config):
  if config.stash.get(_MADE_CACHE, False):
    shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True)


_MADE_CACHE = pytest.StashKey[bool]()


CORPORA = ("fra-eng", "multi30k", "en-fr-test", "shakespeare")  # What `download` writes.


def pytest_sessionstart(session):
  """The tests train and translate on the real corpora: without them, one line saying where."""
  missing = [name for name in CORPORA if not (DATA / name).is_dir()]
  if missing:
    raise pytest.UsageError(
        f"no {', '.join(missing)} in {DATA}: run `python -m transformer_jax download --out "
        "data` (without internet: --mirror DIR or TRANSFORMER_JAX_MIRROR=DIR, a directory "
        "holding the source files), or set TRANSFORMER_JAX_DATA to a directory that holds "
        f"{', '.join(CORPORA)}")


def _run_dir(tmp_path_factory) -> Path:
  """A directory of this pytest run that its xdist workers share (each worker's basetemp lies
  in it); the basetemp itself without xdist."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _run_lock(tmp_path_factory, name: str):
  """An exclusive lock of the run's workers on `name` (a file lock: one worker at a time)."""
  with open(_run_dir(tmp_path_factory) / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _tree_digest(root: Path) -> str:
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*")):
    digest.update(str(path.relative_to(root)).encode() + b"\0")
    if path.is_file():
      digest.update(path.read_bytes())
  return digest.hexdigest()


@pytest.fixture(scope="session")
def cache_dir() -> Path:
  """The run's persistent compilation cache (pytest_configure), for the processes the tests
  start (train.py, translate, serve): jax writes an entry whole or, where another process reads
  it half-written, compiles the program again."""
  return Path(os.environ[CACHE_ENV])


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="session")
def fra_eng_builder(tfds_dir):
  from transformer_jax.data import sources
  return sources.prepare("fra_eng", tfds_dir, str(DATA / "fra-eng"))


@pytest.fixture
def smoke_config(tfds_dir, cache_dir):
  """configs/fra_eng.py:smoke pointed at the corpus and the tests' compilation cache."""
  from configs import fra_eng
  config = fra_eng.get_config("smoke")
  config.data.update(data_dir=str(DATA / "fra-eng"), tfds_dir=tfds_dir)
  config.run.compilation_cache_dir = str(cache_dir)
  return config


def tiny_model_config(**overrides):
  """One tiny model for all model, sharding and step tests."""
  from transformer_jax.models.common import TransformerConfig
  kwargs = dict(src_vocab_size=128, tgt_vocab_size=128, d_model=32, num_heads=4, ffn_dim=64,
                num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                share_embeddings=False, tie_output=False, attention_impl="xla")
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tfds_dir, cache_dir, fra_eng_builder):
  """A 20-step smoke run with checkpoints 10 and 20, keeping a moving average of the parameters
  whatever the recipe does. Trained once a run by the first worker that asks, and read by all:
  tests copy it before changing it, and each worker checks at its end that it did not change."""
  from transformer_jax.training import trainer
  from configs import fra_eng
  config = fra_eng.get_config("smoke")
  config.data.update(data_dir=str(DATA / "fra-eng"), tfds_dir=tfds_dir, num_workers="0")
  config.eval.bleu_sentences = 0
  config.run.compilation_cache_dir = str(cache_dir)
  config.step.ema_decay = 0.9
  workdir = _run_dir(tmp_path_factory) / "trained"
  with _run_lock(tmp_path_factory, "trained"):
    done = workdir.with_name("trained.sha256")
    if not done.exists():
      shutil.rmtree(workdir, ignore_errors=True)  # A worker that failed halfway.
      trainer.train_and_evaluate(config, str(workdir))
      done.write_text(_tree_digest(workdir))
  yield config, workdir
  assert _tree_digest(workdir) == done.read_text(), f"a test changed the shared run {workdir}"


@pytest.fixture(scope="session")
def lm_run(tmp_path_factory, tfds_dir, cache_dir):
  """The smoke language model (tests/runs.py:lm_command), trained by train.py once a run by
  the first worker that asks and read by all (checked unchanged at each worker's end, as
  `trained`)."""
  from tests import runs
  workdir = _run_dir(tmp_path_factory) / "lm_run"
  with _run_lock(tmp_path_factory, "lm_run"):
    done = workdir.with_name("lm_run.sha256")
    if not done.exists():
      shutil.rmtree(workdir, ignore_errors=True)
      runs.run(runs.lm_command(workdir, tfds_dir, cache_dir))
      done.write_text(_tree_digest(workdir))
  yield workdir
  assert _tree_digest(workdir) == done.read_text(), f"a test changed the shared run {workdir}"
