"""Preemption, kills, non-finite steps and damaged checkpoints, with real processes, real
signals and real orbax checkpoints (the smoke config on the shared fra-eng data)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.conftest import DATA, ROOT
from transformer_jax import checkpoint, sharding
from transformer_jax.training import goodput, steps as step_lib, trainer
from transformer_jax.training.average import state_of
from transformer_jax.runs.restore import open_run
from transformer_jax.runs.workdir import Workdir, WorkdirError
from transformer_jax.decoding.translator import Translator

NUM_STEPS = 30


def _command(workdir, tfds_dir, cache_dir, *extra):
  return [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
          "--workdir", str(workdir), f"--config.data.data_dir={DATA / 'fra-eng'}",
          f"--config.data.tfds_dir={tfds_dir}", f"--config.run.compilation_cache_dir={cache_dir}",
          f"--config.run.num_steps={NUM_STEPS}", "--config.run.log_every=1",
          "--config.run.checkpoint_every=4", "--config.run.keep_checkpoints=2",
          "--config.eval.every=1000", "--config.eval.bleu_sentences=0", *extra]


def _start(workdir, tfds_dir, cache_dir, *extra, workers=0):
  """train.py in its own process group (as a scheduler runs it), stdout and stderr merged."""
  extra = (*extra, f"--config.data.num_workers={workers}")
  return subprocess.Popen(_command(workdir, tfds_dir, cache_dir, *extra), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)


def _run(workdir, tfds_dir, cache_dir, *extra):
  proc = _start(workdir, tfds_dir, cache_dir, *extra)
  log = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, log[-3000:]
  return log


def _wait_for_line(proc, pattern: str, lines: list[str]) -> re.Match:
  """Reads the process's output until a line matches `pattern` (every line goes to `lines`)."""
  for line in proc.stdout:
    lines.append(line)
    match = re.search(pattern, line)
    if match:
      return match
  raise AssertionError(f"the run ended before {pattern!r}:\n" + "".join(lines[-40:]))


def _final_state(workdir, step=NUM_STEPS):
  return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")


def _assert_bitwise_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _train_records(workdir) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if "train/loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tfds_dir, cache_dir, fra_eng_builder):
  """An uninterrupted run: (workdir, final state, train records)."""
  workdir = tmp_path_factory.mktemp("straight")
  _run(workdir, tfds_dir, cache_dir)
  return workdir, _final_state(workdir), _train_records(workdir)


def _assert_same_run(workdir, straight):
  _, state, records = straight
  _assert_bitwise_equal(_final_state(workdir), state)
  got = _train_records(workdir)
  assert [r["step"] for r in got] == list(range(1, NUM_STEPS + 1))  # Each step once.
  for mine, theirs in zip(got, records):
    assert (mine["train/loss"], mine["train/tokens"]) == (theirs["train/loss"],
                                                          theirs["train/tokens"])


def test_sigterm_saves_the_current_step_and_the_resumed_run_is_exact(tmp_path, tfds_dir,
                                                                     cache_dir, straight):
  at = random.Random().randint(2, NUM_STEPS - 4)
  proc = _start(tmp_path, tfds_dir, cache_dir, workers=1)  # A grain worker gets SIGTERM too.
  lines = []
  _wait_for_line(proc, rf"\] \[{at}\] steps_per_sec", lines)
  os.killpg(proc.pid, signal.SIGTERM)  # The whole group, grain workers included.
  sent = time.monotonic()
  rest = proc.communicate(timeout=60)[0]
  assert proc.returncode == 0, f"SIGTERM at step {at}:\n{rest[-3000:]}"
  assert time.monotonic() - sent < 30
  stopped = int(re.search(r"Stopped at step (\d+) by a signal", rest).group(1))
  assert at <= stopped < NUM_STEPS
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == stopped, (at, steps)

  log = _run(tmp_path, tfds_dir, cache_dir)
  assert f"Resuming from the checkpoint of step {stopped}" in log
  _assert_same_run(tmp_path, straight)


def test_sigkill_at_three_moments_loses_nothing(tmp_path, tfds_dir, cache_dir, straight):
  """Three SIGKILLs at random steps of three moments, then a run to the end: the same run as
  an uninterrupted one, and a goodput ledger of four lives whose buckets add up to the wall
  time the lives took, with the steps each kill lost counted as recomputed."""
  checkpoints = tmp_path / "checkpoints"
  rng = random.Random()
  walls, reached = [], []

  def kill_when(ready):
    """Starts a run and SIGKILLs its process group as soon as `ready(lines so far)`."""
    began = time.time()
    proc = _start(tmp_path, tfds_dir, cache_dir)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not ready(lines):
      assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
      time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    walls.append(time.time() - began)  # Its life: up to the kill (not the kernel's clean-up).
    proc.wait()
    reader.join()
    reached.append(max(r["step"] for r in _train_records(tmp_path)))  # Before the next run.
    return "".join(lines)

  def logged(step):
    return lambda lines: any(f"] [{step}] steps_per_sec" in line for line in lines)

  def saving(after_step):  # An asynchronous save under way: orbax's temporary directory.
    return lambda lines: logged(after_step)(lines) and any(
        ".orbax-checkpoint-tmp" in p.name for p in checkpoints.glob("*"))

  logs = [kill_when(logged(rng.randint(5, 7)))]  # Between checkpoints 4 and 8.
  logs.append(kill_when(saving(rng.randint(9, 20))))  # While a checkpoint is being written.
  logs.append(kill_when(logged(NUM_STEPS - rng.randint(2, 3))))  # Close to the end.
  # Every step logged before the last kill is in metrics.jsonl, once.
  steps = [r["step"] for r in _train_records(tmp_path)]
  assert len(steps) >= NUM_STEPS - 3 and steps == list(range(1, len(steps) + 1))

  began = time.time()
  logs.append(_run(tmp_path, tfds_dir, cache_dir))
  walls.append(time.time() - began)
  # A killed run's lock is the operating system's: gone with it, and the next run says so.
  assert re.search(rf"{tmp_path} was left locked by process \d+ on .+, which has ended: taking it "
                   "over", logs[-1])
  _assert_same_run(tmp_path, straight)

  lives = goodput.read(tmp_path / goodput.FILE)
  # Where each life began: a kill before the first checkpoint was written starts afresh.
  resumed = [int(m.group(1)) if (m := re.search(r"Resuming from the checkpoint of step (\d+)",
                                                log)) else 0 for log in logs]
  assert [(life["life"], life["from_step"]) for life in lives] == list(enumerate(resumed, 1))
  # The steps each kill lost (its reach in metrics.jsonl, less the next life's checkpoint).
  lost = [0] + [reach - start for reach, start in zip(reached, resumed[1:])]
  assert [life["recomputed_steps"] for life in lives] == lost, (reached, resumed)
  assert lives[-1]["step"] == NUM_STEPS
  for life, wall in zip(lives, walls):  # Each bucket of each life: >= 0, all of its time.
    assert min(life["seconds"].values()) >= 0
    assert sum(life["seconds"].values()) == pytest.approx(life["updated"] - life["started"],
                                                          abs=0.01)
  total = goodput.summary(lives)
  assert total["wall"] == pytest.approx(sum(walls), rel=0.01), [
      (wall, life["updated"] - life["started"]) for wall, life in zip(walls, lives)]
  assert total["recomputed_steps"] == sum(lost) and total["seconds"]["recomputed"] > 0
  report = subprocess.run([sys.executable, "-m", "transformer_jax", "report", "--workdir",
                           str(tmp_path), "--png", str(tmp_path.parent / "report.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert report.returncode == 0, report.stderr[-2000:]
  assert f"4 lives, {total['wall']:,.1f} s of wall time, step {NUM_STEPS} reached" in report.stdout
  assert f"({sum(lost)} steps)" in report.stdout
  assert (tmp_path.parent / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_second_run_on_a_busy_workdir_is_one_line_and_writes_nothing(tmp_path, tfds_dir,
                                                                       cache_dir):
  # The first run has steps enough to be running still when the second starts; SIGTERM ends it.
  first = _start(tmp_path, tfds_dir, cache_dir, "--config.run.num_steps=100000")
  lines = []
  _wait_for_line(first, r"\] \[2\] steps_per_sec", lines)
  reader = threading.Thread(target=lambda: lines.extend(first.stdout), daemon=True)
  reader.start()
  second = subprocess.run(_command(tmp_path, tfds_dir, cache_dir), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert first.poll() is None, "".join(lines[-40:])  # Still running: the refusal was the lock's.
  assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
  assert second.stderr.strip().splitlines()[-1] == (
      f"error: --workdir {tmp_path} is being written by process {first.pid} on "
      f"{socket.gethostname()}: wait for that run to end, or name another workdir")
  os.killpg(first.pid, signal.SIGTERM)
  assert first.wait(timeout=120) == 0, "".join(lines[-40:])
  reader.join()
  # One writer: every step logged once, and the lock released (its file gone with it).
  steps = [r["step"] for r in _train_records(tmp_path)]
  assert len(steps) >= 2 and steps == list(range(1, len(steps) + 1))
  assert not (tmp_path / "writer.lock").exists()


def _finite_checkpoints(workdir) -> list[int]:
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  for step in steps:
    state = _final_state(workdir, step)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state)
               if np.issubdtype(np.asarray(x).dtype, np.floating)), step
  return steps


def test_injected_nan_stops_or_is_skipped_and_never_reaches_a_checkpoint(tmp_path, smoke_config):
  smoke_config.update(dict(step=dict(nan_at_step=13), eval=dict(every=1000, bleu_sentences=0),
                           run=dict(checkpoint_every=5, keep_checkpoints=2, num_steps=20),
                           data=dict(num_workers="0")))
  stop = smoke_config.copy_and_resolve_references()
  with pytest.raises(step_lib.NonFiniteError, match="non-finite loss or gradients at step 13"):
    trainer.train_and_evaluate(stop, str(tmp_path / "stop"))
  # The checkpoint of step 15 would hold the state after the dropped step 13: never written.
  assert _finite_checkpoints(tmp_path / "stop") == [5, 10]

  skip = smoke_config.copy_and_resolve_references()
  skip.run.nonfinite = "skip"
  state = trainer.train_and_evaluate(skip, str(tmp_path / "skip"))
  assert int(state.step) == 20
  assert _finite_checkpoints(tmp_path / "skip") == [15, 20]
  records = {r["step"]: r for r in _train_records(tmp_path / "skip")}
  assert records[10]["train/skipped_steps"] == 0 and records[15]["train/skipped_steps"] == 1
  assert records[20]["train/skipped_steps"] == 1

  # Too many in a row: every step from 1 is NaN with a learning rate that overflows.
  burst = smoke_config.copy_and_resolve_references()
  burst.update(dict(run=dict(nonfinite="skip", max_nonfinite_in_row=3),
                    step=dict(nan_at_step=0),
                    optimizer=dict(learning_rate=1e38, warmup_steps=0, grad_clip=0.0)))
  with pytest.raises(step_lib.NonFiniteError, match="3 non-finite steps in a row"):
    trainer.train_and_evaluate(burst, str(tmp_path / "burst"))


def _damage(step_dir, kind, every_chunk=False):
  """Damages one checkpoint's state: its largest data file (or every one). Changed bytes: 64
  of every 4 KiB, so that whichever arrays a reader reads (translate reads only the parameters
  or only their moving average), some of theirs are hit whatever the file's layout."""
  state = step_dir / "state"
  chunks = sorted((state / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
  noise = bytes(random.Random(0).randrange(256) for _ in range(64))
  for chunk in chunks if every_chunk else chunks[-1:]:
    if kind == "deleted chunk":
      chunk.unlink()
    elif kind == "changed bytes":
      with open(chunk, "r+b") as f:
        for offset in range(chunk.stat().st_size // 2 % 4096, chunk.stat().st_size - 64, 4096):
          f.seek(offset)
          f.write(noise)
  if kind == "emptied metadata":
    (state / "_METADATA").write_text("")


def _restore_latest(config, workdir):
  """What train.py does at start-up: restore the newest checkpoint that verifies."""
  state, shardings = state_of(open_run(Workdir(workdir)))
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", 10, 3)
  try:
    return ckpt.restore_latest(state, shardings)
  finally:
    ckpt.close()


@pytest.mark.parametrize("kind", ["deleted chunk", "emptied metadata", "changed bytes"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, trained, kind,
                                                                    caplog):
  config, source = trained
  # translate reads only the parameters: damage every data file so that theirs are hit.
  for_translate = tmp_path / "t"
  shutil.copytree(source, for_translate)
  _damage(for_translate / "checkpoints" / "20", kind, every_chunk=True)
  translator = Translator(for_translate)  # Reads only: uses step 10, renames nothing.
  assert translator.step == 10
  assert "The checkpoint of step 20" in caplog.text and "damaged" in caplog.text
  assert (for_translate / "checkpoints" / "20").exists()

  # Training's restore, when one data file of 20 is damaged (as a disk would do it).
  caplog.clear()
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  _damage(workdir / "checkpoints" / "20", kind)
  step, state, data = _restore_latest(config, workdir)
  assert step == int(state.step) == 10 and set(data) == {"block", "batch"}
  assert "The checkpoint of step 20" in caplog.text and "damaged" in caplog.text
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "damaged-20"]


def test_training_resumes_from_the_last_good_checkpoint(tmp_path, trained, caplog):
  config, source = trained
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  _damage(workdir / "checkpoints" / "20", "changed bytes", every_chunk=True)
  caplog.set_level("INFO")
  # The same command again (the same num_steps: the recipe's cosine schedule depends on it).
  state = trainer.train_and_evaluate(config.copy_and_resolve_references(), str(workdir))
  assert int(state.step) == 20
  assert "The checkpoint of step 20" in caplog.text and "damaged" in caplog.text
  assert "Resuming from the checkpoint of step 10" in caplog.text
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [
      "10", "20", "damaged-20"]
  assert _finite_checkpoints(workdir) == [10, 20]
  # The new 20 is the undamaged run's 20 again (the same batches, dropout and learning rates
  # from step 10), moving average included.
  _assert_bitwise_equal(_final_state(workdir, 20), _final_state(source, 20))


_NEVER_RETRIEVED = """
import asyncio, gc
from transformer_jax import checkpoint
checkpoint._drop_abandoned_io_echoes()

async def fail(error):
  raise error

loop = asyncio.new_event_loop()
tasks = [loop.create_task(fail(Exception("Encountered error while reading array index: (0,)"))),
         loop.create_task(fail(ValueError("another task's error")))]
loop.run_until_complete(asyncio.sleep(0.01))
del tasks
gc.collect()
loop.close()
print("done")
"""


def test_a_damaged_reads_never_retrieved_tasks_are_dropped_and_no_other_error():
  """A read of a damaged checkpoint leaves tasks whose errors asyncio's logger reports, with
  their tracebacks, when they are collected (at any time, even before the command's error
  line): those are dropped; an unrelated task's error still prints."""
  proc = subprocess.run([sys.executable, "-c", _NEVER_RETRIEVED], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]
  assert "Encountered error" not in proc.stderr
  assert "Task exception was never retrieved" in proc.stderr
  assert "another task's error" in proc.stderr


def test_every_checkpoint_damaged_is_one_line(tmp_path, trained):
  _, source = trained
  workdir = tmp_path / "w"
  shutil.copytree(source, workdir)
  for step in (10, 20):
    _damage(workdir / "checkpoints" / str(step), "changed bytes", every_chunk=True)
  with pytest.raises(checkpoint.CheckpointDamagedError, match=r"every checkpoint in .* is damaged"):
    Translator(workdir)
  proc = subprocess.run([sys.executable, "-m", "transformer_jax", "translate", "--workdir",
                         str(workdir), "Go."], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: every checkpoint in ")
  assert "Traceback" not in proc.stderr and "never awaited" not in proc.stderr
  assert proc.stdout == ""


def test_num_steps_below_the_latest_checkpoint_is_an_error(trained):
  config, source = trained
  config = config.copy_and_resolve_references()
  config.run.num_steps = 15
  before = (source / "metrics.jsonl").read_text()
  with pytest.raises(WorkdirError, match=r"run.num_steps=15 is below the latest "
                     r"checkpoint's step \(20\)"):
    trainer.train_and_evaluate(config, str(source))
  assert (source / "metrics.jsonl").read_text() == before
  assert sorted(p.name for p in (source / "checkpoints").iterdir()) == ["10", "20"]


@pytest.mark.quick
def test_fingerprints_are_the_same_in_numpy_as_on_the_device():
  """A CPU's arrays are fingerprinted with numpy (no program to compile at each restore),
  others on their device: both give the same sums for every dtype a state holds, and one
  changed value changes them."""
  rng = np.random.default_rng(0)
  tree = {"float32": rng.normal(size=(300, 77)).astype(np.float32),
          "int32": rng.integers(-5, 5, (13,), dtype=np.int32), "bool": rng.random(7) > 0.5,
          "bfloat16": jax.numpy.asarray(rng.normal(size=(5, 3)), jax.numpy.bfloat16),
          "uint8": np.arange(9, dtype=np.uint8), "scalar": jax.numpy.float32(3.5),
          "key": jax.random.key_data(jax.random.PRNGKey(3))}
  tree = jax.tree.map(jax.numpy.asarray, tree)
  host = checkpoint.fingerprints(tree)
  assert all(isinstance(f, np.ndarray) for f in host)  # Computed by numpy.
  device = checkpoint._device_fingerprints(tree)
  assert [f.tolist() for f in host] == [np.asarray(f).tolist() for f in device]
  changed = dict(tree, float32=tree["float32"].at[123, 4].add(1e-3))
  at = sorted(tree).index("float32")  # Leaves in the order of their keys.
  assert (checkpoint.fingerprints(changed)[at] != host[at]).all()


@flax.struct.dataclass
class _State:
  """A training state's fields as the checkpoint names them (`.params`, `.step`)."""
  params: dict
  step: np.ndarray


@pytest.mark.quick
def test_parameters_of_another_model_are_named_after_the_restore_that_found_them(tmp_path,
                                                                               monkeypatch):
  """Restoring only the parameters reads the checkpoint's metadata (every array's, the slow
  part of a restore) only where the arrays read back are not the model's: then the error names
  the array that differs, as a check before reading would."""
  ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", 1, 1)
  params = {"a": np.arange(32, dtype=np.float32).reshape(4, 8), "b": np.ones(3, np.float32)}
  ckpt.save(1, _State(params=params, step=np.int32(1)), {"batch": 0}, force=True)
  ckpt.close()
  reader = checkpoint.Checkpointer(tmp_path / "checkpoints", 1, 1, read_only=True)
  mesh = sharding.make_mesh((-1, 1, 1))
  like = lambda **shapes: {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()}

  metadata_read = []
  read_metadata = reader._stored_shapes
  monkeypatch.setattr(reader, "_stored_shapes",
                      lambda step: metadata_read.append(step) or read_metadata(step))
  got = reader.restore_params(1, like(a=(4, 8), b=(3,)), mesh)
  assert jax.tree.map(np.asarray, got).keys() == params.keys()
  assert all(np.array_equal(got[k], params[k]) for k in params)
  assert metadata_read == []  # The arrays were the model's: no metadata read.
  # An accelerator's way: read into host memory and verified there, then put on the mesh.
  put = []
  device_put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda x, s=None, **kw: (  # orbax puts arrays too.
      isinstance(s, dict) and put.append(s)) or device_put(x, s, **kw))
  via_host = reader.restore_params(1, like(a=(4, 8), b=(3,)), mesh, via_host=True)
  assert [sorted(s) for s in put] == [["a", "b"]]  # The whole tree, in one call.
  assert all(np.array_equal(via_host[k], params[k]) and via_host[k].sharding == put[0][k]
             and via_host[k].sharding.mesh == mesh for k in params)
  monkeypatch.setattr(jax, "device_put", device_put)

  for model, message in [(like(a=(4, 16), b=(3,)), "params.a is (4, 8) there, (4, 16) in"),
                         (like(a=(4, 8)), "params.b is there, not in the model"),
                         (like(a=(4, 8), b=(3,), c=(2,)), "params.c is missing there")]:
    with pytest.raises(checkpoint.CheckpointMismatchError, match=re.escape(message)):
      reader.restore_params(1, model, mesh)
  assert metadata_read == [1, 1, 1]
  reader.close()
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]


_CLOSED_LOOP = """
import asyncio, sys, tempfile
import tensorstore as ts
from transformer_jax import checkpoint
checkpoint.Checkpointer(tempfile.mkdtemp(), save_every=1, keep=1)

async def wait_for(future):
  await future

promise, future = ts.Promise.new()
loop = asyncio.new_event_loop()
task = loop.create_task(wait_for(future))
loop.run_until_complete(asyncio.sleep(0.01))
loop.close()
promise.set_result(1)  # tensorstore calls back into the closed loop, as a write does on ENOSPC.

class Another:
  def __del__(self):
    raise ValueError("another")

Another()  # Collected at once: its error goes through the same hook.
print("done")
"""


def test_a_write_that_outlives_orbaxs_event_loop_is_not_echoed():
  """When a checkpoint write fails (a full disk), orbax closes its event loop while tensorstore
  finishes the other writes; each then calls back into the closed loop and Python prints a
  bare traceback, during training, before the one error line. A checkpointer drops those from
  its making on; any other unraisable error still prints."""
  proc = subprocess.run([sys.executable, "-c", _CLOSED_LOOP], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]
  assert "Event loop is closed" not in proc.stderr, proc.stderr[-2000:]
  assert "ValueError: another" in proc.stderr


@pytest.mark.parametrize("optimizer", [
    ("--config.optimizer.name=muon",),
    ("--config.optimizer.name=schedule_free_adamw", "--config.optimizer.schedule=constant")])
def test_muon_and_schedule_free_runs_resume_exactly_after_a_kill(tmp_path, tfds_dir, cache_dir,
                                                                 fra_eng_builder, optimizer):
  """SIGKILLed at a random step past the first checkpoint, then run to the end: the state
  (Muon's momentum and Adam's moments; schedule-free's points and the evaluation parameters
  it keeps) bit for bit an uninterrupted run's."""
  straight_dir = tmp_path / "straight"
  _run(straight_dir, tfds_dir, cache_dir, *optimizer)
  killed = tmp_path / "killed"
  at = random.Random().randint(6, NUM_STEPS - 8)
  proc = _start(killed, tfds_dir, cache_dir, *optimizer)
  lines = []
  _wait_for_line(proc, rf"\] \[{at}\] steps_per_sec", lines)
  # Past a committed checkpoint (orbax renames it when its writes end, a step or more later),
  # and the kill lands a few steps after the line is read: at step 28 at the latest.
  while not any(p.name.isdigit() for p in (killed / "checkpoints").glob("*")):
    _wait_for_line(proc, r"\] \[\d+\] steps_per_sec", lines)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  proc.stdout.close()
  log = _run(killed, tfds_dir, cache_dir, *optimizer)
  assert re.search(r"Resuming from the checkpoint of step (4|8|12|16|20|24|28)\b", log), log[-3000:]
  state = _final_state(killed)
  if "schedule_free" in optimizer[0]:  # Evaluation reads its own parameters, kept apart.
    assert state["ema_params"] is not None
  _assert_bitwise_equal(state, _final_state(straight_dir))
  assert [r["train/loss"] for r in _train_records(killed)] == [
      r["train/loss"] for r in _train_records(straight_dir)]
