"""Compiled programs kept on disk (programs.py): a later store runs them without tracing
or compiling."""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import serialize_executable

from transformer_jax.programs import ProgramStore

pytestmark = pytest.mark.quick


def _counted():
  traces = []

  def fn(state, x):
    traces.append(1)  # Python runs only while jax traces.
    return {"sum": state["sum"] + x.sum(), "last": x * 2}
  return fn, traces


def test_a_second_store_runs_the_kept_program_without_tracing(tmp_path):
  fn, traces = _counted()
  state, x = {"sum": jnp.zeros(()), "last": jnp.zeros(3)}, jnp.arange(3.0)
  first = ProgramStore(tmp_path).jit("add", "v1", fn, donate_argnums=0)(state, x)
  assert len(traces) == 1 and len(list(tmp_path.glob("add-*.executable"))) == 1

  fn2, traces2 = _counted()
  state = {"sum": jnp.zeros(()), "last": jnp.zeros(3)}
  again = ProgramStore(tmp_path).jit("add", "v1", fn2, donate_argnums=0)(state, x)
  assert traces2 == []  # Loaded, not traced.
  np.testing.assert_array_equal(again["last"], first["last"])
  assert float(again["sum"]) == float(first["sum"]) == 3.0

  assert state["sum"].is_deleted()  # Donated, as asked (the buffer XLA aliases, as jax.jit does).
  # Another description, or other shapes, is another program.
  ProgramStore(tmp_path).jit("add", "v2", fn2)({"sum": jnp.zeros(()), "last": x}, x)
  ProgramStore(tmp_path).jit("add", "v1", fn2)({"sum": jnp.zeros(()), "last": x}, jnp.arange(4.0))
  assert len(traces2) == 2 and len(list(tmp_path.glob("add-*.executable"))) == 3


def test_a_damaged_program_is_compiled_again_with_a_warning(tmp_path, caplog):
  fn, traces = _counted()
  x = jnp.arange(3.0)
  ProgramStore(tmp_path).jit("add", "v1", fn)({"sum": jnp.zeros(())}, x)
  (path,) = tmp_path.glob("add-*.executable")
  path.write_bytes(path.read_bytes()[:100])
  fn2, traces2 = _counted()
  out = ProgramStore(tmp_path).jit("add", "v1", fn2)({"sum": jnp.zeros(())}, x)
  assert float(out["sum"]) == 3.0 and len(traces2) == 1
  assert "did not load" in caplog.text


def test_without_a_directory_nothing_is_kept(tmp_path):
  fn, traces = _counted()
  out = ProgramStore(None).jit("add", "v1", fn)({"sum": jnp.zeros(())}, jnp.ones(2))
  assert float(out["sum"]) == 2.0 and list(tmp_path.iterdir()) == []


def test_a_value_is_computed_once_and_read_back_by_a_later_store(tmp_path, caplog):
  """What a command's start computes (a model's abstract parameters) is kept like a program:
  a later store reads it back; another description is another value; a damaged file is
  computed again with a warning; without a directory it is computed each time."""
  calls = []
  compute = lambda: calls.append(1) or {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
  first = ProgramStore(tmp_path).value("abstract", "model v1", compute)
  again = ProgramStore(tmp_path).value("abstract", "model v1", compute)
  assert again == first and len(calls) == 1
  ProgramStore(tmp_path).value("abstract", "model v2", compute)
  assert len(calls) == 2 and len(list(tmp_path.glob("abstract-*.pickle"))) == 2

  for path in tmp_path.glob("abstract-*.pickle"):
    path.write_bytes(path.read_bytes()[:10])
  assert ProgramStore(tmp_path).value("abstract", "model v1", compute) == first
  assert len(calls) == 3 and "did not load" in caplog.text
  assert ProgramStore(tmp_path).value("abstract", "model v1", compute) == first
  assert len(calls) == 3  # The damaged file was replaced.

  ProgramStore(None).value("abstract", "model v1", compute)
  ProgramStore(None).value("abstract", "model v1", compute)
  assert len(calls) == 5


@pytest.mark.parametrize("kept", [False, True])
def test_threads_that_meet_a_program_at_once_compile_it_once(tmp_path, kept):
  fn, traces = _counted()
  add = ProgramStore(tmp_path if kept else None).jit("add", "v1", fn)
  start, outs = threading.Barrier(4), []

  def call():
    start.wait()
    outs.append(float(add({"sum": jnp.zeros(())}, jnp.ones(5))["sum"]))

  threads = [threading.Thread(target=call) for _ in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert outs == [5.0] * 4 and len(traces) == 1


def test_arguments_of_another_dtype_or_weak_type_are_other_programs(tmp_path):
  """numpy and jax arrays, numpy scalars and Python numbers: each kind of argument that jax
  would trace apart gets its own program, kept apart on disk."""
  fn, traces = _counted()
  add = ProgramStore(tmp_path).jit("add", "v1", fn)
  state = lambda: {"sum": jnp.zeros(())}
  calls = [np.arange(3, dtype=np.float32), np.arange(3, dtype=np.float32) + 1,  # One program,
           jnp.arange(3.0),  # the same as a jax array: float32, not weak.
           np.arange(3, dtype=np.int32),  # Another dtype.
           np.float32(2.0), jnp.asarray(2.0), 2.0, 3.0, 2]  # Scalars: strong, weak, int.
  assert jnp.asarray(2.0).weak_type  # The same program as a Python float's.
  sums = [float(add(state(), x)["sum"]) for x in calls]
  assert sums == [3.0, 6.0, 3.0, 3.0, 2.0, 2.0, 2.0, 3.0, 2.0]
  assert len(traces) == 5  # float32 [3], int32 [3], float32 (), weak float (), weak int ().
  assert len(list(tmp_path.glob("add-*.executable"))) == 5



@pytest.mark.parametrize("kept", [False, True])
def test_compile_readies_a_program_without_running_it(tmp_path, kept):
  fn, traces = _counted()
  store = ProgramStore(tmp_path if kept else None)
  add = store.jit("add", "v1", fn, donate_argnums=0)
  state = {"sum": jnp.zeros(()), "last": jnp.zeros(3)}
  shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  add.compile(jax.tree.map(shape, state), jax.ShapeDtypeStruct((3,), jnp.float32))
  assert len(traces) == 1 and store.compiled == 1
  assert not state["sum"].is_deleted()  # Not run: its donated argument is still there.
  out = add(state, jnp.arange(3.0))
  assert len(traces) == 1 and float(out["sum"]) == 3.0 and state["sum"].is_deleted()


def test_functions_of_a_store_with_the_same_key_share_its_program(tmp_path):
  fn, traces = _counted()
  store = ProgramStore(tmp_path)
  store.jit("add", "v1", fn).compile({"sum": jnp.zeros(())}, jnp.ones(3))
  (path,) = tmp_path.glob("add-*.executable")
  path.unlink()  # So the second can only take the first's program.
  fn2, traces2 = _counted()
  out = store.jit("add", "v1", fn2)({"sum": jnp.zeros(())}, jnp.ones(3))
  assert float(out["sum"]) == 3.0 and traces2 == [] and store.compiled == 1
  assert list(tmp_path.glob("add-*.executable")) == []
  store.jit("add", "v2", fn2)({"sum": jnp.zeros(())}, jnp.ones(3))  # Another key: its own.
  assert len(traces2) == 1 and store.compiled == 2


def _two_programs(store):
  fn, traces = _counted()
  add = store.jit("add", "v1", fn)
  double = store.jit("double", "v1", lambda x: x * 2)
  return add, double, traces


def test_a_store_preloads_what_the_last_command_of_the_same_settings_called(tmp_path,
                                                                          monkeypatch):
  add, double, _ = _two_programs(ProgramStore(tmp_path))
  add({"sum": jnp.zeros(())}, jnp.ones(3))
  double(jnp.arange(4.0))
  ProgramStore(tmp_path).remember("nothing called")  # Writes no list.
  first = ProgramStore(tmp_path)
  assert first.preload("greedy") is None  # No list yet.
  add, double, _ = _two_programs(first)
  double(jnp.arange(4.0))
  add({"sum": jnp.zeros(())}, jnp.ones(3))
  first.remember("greedy")
  assert len(list(tmp_path.glob("used-*.json"))) == 1

  store = ProgramStore(tmp_path)
  store.preload("greedy").join()
  assert store.preloaded == 2
  monkeypatch.setattr(serialize_executable, "deserialize_and_load", None)  # Nothing loads now.
  add, double, traces = _two_programs(store)
  assert float(add({"sum": jnp.zeros(())}, jnp.ones(3))["sum"]) == 3.0
  np.testing.assert_array_equal(double(jnp.arange(4.0)), [0.0, 2.0, 4.0, 6.0])
  assert traces == []
  other = ProgramStore(tmp_path)
  assert other.preload("beam 4") is None and other.preloaded == 0
  # A list that is not this store's (damaged, or naming files elsewhere) loads nothing.
  (listed,) = tmp_path.glob("used-*.json")
  for text in ("5", '{"a": 1}', '["../add.executable", 3]', "[cut"):
    listed.write_text(text)
    store = ProgramStore(tmp_path)
    thread = store.preload("greedy")
    if thread is not None:
      thread.join()
    assert store.preloaded == 0


def test_preloading_skips_what_a_call_took_first_and_a_damaged_program(tmp_path, caplog):
  first = ProgramStore(tmp_path)
  add, double, _ = _two_programs(first)
  add({"sum": jnp.zeros(())}, jnp.ones(3))
  double(jnp.arange(4.0))
  first.remember("greedy")
  (kept,) = tmp_path.glob("double-*.executable")
  kept.write_bytes(kept.read_bytes()[:100])

  store = ProgramStore(tmp_path)
  add, double, traces = _two_programs(store)
  assert float(add({"sum": jnp.zeros(())}, jnp.ones(3))["sum"]) == 3.0  # Before the thread.
  store.preload("greedy").join()
  assert store.preloaded == 0  # add was loaded by its call, double did not load.
  assert store.loaded == 1  # What /metrics' programs_loaded_total reads: add's.
  np.testing.assert_array_equal(double(jnp.arange(4.0)), [0.0, 2.0, 4.0, 6.0])
  assert traces == [] and "compiling double again" in caplog.text


def test_a_store_past_its_size_removes_its_least_recently_used_files(tmp_path, caplog):
  """A write past `max_bytes` removes the store's files used least recently, down to three
  quarters of it: never the files this process used or wrote, nor a file of another kind; a
  program loaded counts as used then."""
  fn, _ = _counted()
  x = jnp.arange(3.0)
  ProgramStore(tmp_path).jit("add", "v1", fn)({"sum": jnp.zeros(())}, x)
  (program,) = tmp_path.glob("add-*.executable")
  size = program.stat().st_size
  assert size < 100_000  # The sizes below assume it.
  # Six older programs of 100 KB (of earlier builds, say), the oldest first, and a file of the
  # user's, older still.
  old = [tmp_path / f"old{i}-0.executable" for i in range(6)]
  for i, path in enumerate(old):
    path.write_bytes(bytes(100_000))
    os.utime(path, (1_000 + i, 1_000 + i))
  notes = tmp_path / "notes.txt"
  notes.write_bytes(bytes(500_000))
  os.utime(notes, (0, 0))
  os.utime(program, (0, 0))  # The oldest of the store's files, until loaded again.

  # A later process: loads the program (now the most recent) and writes another past the size.
  store = ProgramStore(tmp_path, max_bytes=size + 300_000)
  store.jit("add", "v1", fn)({"sum": jnp.zeros(())}, x)
  assert program.stat().st_mtime > 1_000 + 6
  with caplog.at_level("INFO"):
    store.jit("add", "v2", fn)({"sum": jnp.zeros(())}, x)  # A write: held size + 600 KB.
  # Down to 3/4 of the size: the four oldest programs go, the two newer stay.
  assert [path.exists() for path in old] == [False] * 4 + [True] * 2
  assert program.exists() and len(list(tmp_path.glob("add-*.executable"))) == 2
  assert notes.exists()
  assert "removed 4 kept files used least recently" in caplog.text

  # Another process, which used none of them: the least recently used go first, the program
  # loaded above last of all.
  os.utime(program)
  removed = ProgramStore(tmp_path, max_bytes=150_000).prune()
  assert program not in removed and old[4] in removed and notes.exists()
