"""Runs on localhost with fake CPU devices: two processes x two devices as one 4-device
data-parallel run; runs that move between 2 processes and 1 (4 devices either way) and between
1 device and 4; two processes that find each other from SLURM's variables and stop together."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import portpicker
import pytest

from tests.conftest import DATA, ROOT, xla_flags


def _train(workdir, tfds_dir, cache_dir, num_steps, processes, extra=(), devices=4):
  """Runs train.py's smoke config on `devices` CPU devices (data parallel) in `processes`
  processes, sharing the compilation cache `cache_dir`; returns the logs."""
  port = portpicker.pick_unused_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices // processes}"))
  cmd = [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
         "--workdir", str(workdir), f"--config.data.data_dir={DATA / 'fra-eng'}",
         f"--config.data.tfds_dir={tfds_dir}", f"--config.run.num_steps={num_steps}",
         f"--config.run.mesh_shape=({devices},1,1)", "--config.eval.bleu_sentences=16",
         "--config.run.log_every=1", "--config.data.num_workers=0",
         f"--config.run.compilation_cache_dir={cache_dir}", *extra]
  if processes > 1:
    cmd += ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes)]
  procs = [subprocess.Popen(cmd + (["--process_id", str(i)] if processes > 1 else []), cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(processes)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0] * processes, "\n".join(l[-3000:] for l in logs)
  return logs


def _train_records(workdir):
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in records if "train/loss" in r}


# A schedule that does not span num_steps: a leg that asks for fewer steps trains the same.
RSQRT = "--config.optimizer.schedule=rsqrt"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, tfds_dir, cache_dir, fra_eng_builder):
  """12 steps of 2 processes x 2 devices, with BLEU: (workdir, each process's log). Also the
  uninterrupted run that the resumed one is held to."""
  workdir = tmp_path_factory.mktemp("two_processes") / "w"
  return workdir, _train(workdir, tfds_dir, cache_dir, 12, processes=2, extra=[RSQRT])


def test_two_process_training_run(two_processes):
  workdir, logs = two_processes
  # Both processes computed the same global evaluations (losses, BLEU) over the 4 devices.
  evals = [[line.split("] ", 1)[1] for line in log.splitlines() if "eval/loss=" in line]
           for log in logs]
  assert evals[0] and evals[0] == evals[1] and all("eval/bleu=" in e for e in evals[0])
  # Only process 0 writes metrics; the data position is one host-independent record.
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "eval/loss" in r] == [10, 12]
  data = json.loads((workdir / "checkpoints" / "12" / "data" / "metadata").read_text())
  assert set(data) == {"block", "batch"}


def test_resuming_on_another_number_of_processes_or_devices_sees_the_same_batches(
    tmp_path, tfds_dir, cache_dir, two_processes):
  straight = _train_records(two_processes[0])
  # (processes, devices) of three legs of 4 steps each: 2 processes on 4 devices -> 1 process on
  # 1 device -> 2 processes on 4 devices again (fewer and more of both).
  workdir = tmp_path / "moved"
  for i, (processes, devices) in enumerate(((2, 4), (1, 1), (2, 4))):
    logs = _train(workdir, tfds_dir, cache_dir, 4 * (i + 1), processes=processes,
                  devices=devices,
                  extra=[RSQRT, "--config.run.checkpoint_every=4",
                         "--config.eval.bleu_sentences=0"])
    if i:
      assert f"Resuming from the checkpoint of step {4 * i}" in logs[0]
  moved = _train_records(workdir)
  assert sorted(moved) == sorted(straight) == list(range(1, 13))
  for step in straight:
    # The same global batches: the same real-token counts exactly, the same losses up to the
    # order of floating-point reductions across processes.
    assert moved[step]["train/tokens"] == straight[step]["train/tokens"], step
    np.testing.assert_allclose(moved[step]["train/loss"], straight[step]["train/loss"],
                               rtol=2e-4, err_msg=f"step {step}")


def test_slurm_environment_two_processes_stop_together_on_sigterm(tmp_path, tfds_dir,
                                                                 fra_eng_builder):
  """Two processes that find each other from SLURM's variables alone (no --num_processes);
  a SIGTERM to one of them stops both at the same step, each after the same checkpoint."""
  job_id = next(j for j in range(1000, 5096)
                if portpicker.is_port_free(j % 4096 + 65535 - 4096 + 1))
  cmd = [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
         "--workdir", str(tmp_path), f"--config.data.data_dir={DATA / 'fra-eng'}",
         f"--config.data.tfds_dir={tfds_dir}", "--config.run.num_steps=100000",
         "--config.run.mesh_shape=(2,1,1)", "--config.eval.bleu_sentences=0",
         "--config.run.log_every=1", "--config.data.num_workers=0", "--config.eval.every=100000",
         "--config.run.checkpoint_every=100000"]
  procs = []
  for rank in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1"),
               SLURM_JOB_ID=str(job_id), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
    out = subprocess.PIPE if rank else open(tmp_path.parent / "rank0.log", "w")
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, text=True))
  lines = []
  for line in procs[1].stdout:  # Both run in step; stop once process 1 has logged step 5.
    lines.append(line)
    if "] [5] steps_per_sec" in line:
      break
  else:
    raise AssertionError("".join(lines[-40:]))
  procs[1].send_signal(signal.SIGTERM)
  logs = ["".join(lines) + procs[1].communicate(timeout=120)[0]]
  procs[0].wait(timeout=120)
  logs.insert(0, (tmp_path.parent / "rank0.log").read_text())
  assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-3000:] for l in logs)
  assert all("Cluster environment 'slurm' detected" in log for log in logs)
  stops = [re.findall(r"Stopped at step (\d+) by a signal", log) for log in logs]
  assert stops[0] == stops[1] and len(stops[0]) == 1, stops
  step = int(stops[0][0])
  assert step >= 5
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [str(step)]


def test_a_process_that_dies_ends_the_other_in_one_line(
    tmp_path, tfds_dir, cache_dir, fra_eng_builder):
  """Process 1 of 2 SIGKILLed mid-run: process 0 ends with one line naming process 1 and the
  step the same command resumes from (not a collective's traceback, then jax's shutdown
  barrier waiting for the dead process and an abort). Resuming a multi-process run from its
  checkpoint is the test above's."""
  workdir = tmp_path / "w"
  port = portpicker.pick_unused_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=1"))
  cmd = [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
         "--workdir", str(workdir), f"--config.data.data_dir={DATA / 'fra-eng'}",
         f"--config.data.tfds_dir={tfds_dir}", "--config.run.num_steps=100000",
         "--config.run.mesh_shape=(2,1,1)", "--config.eval.bleu_sentences=0",
         "--config.run.log_every=1", "--config.data.num_workers=0", "--config.eval.every=100000",
         "--config.run.checkpoint_every=4", f"--config.run.compilation_cache_dir={cache_dir}",
         "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
         "--heartbeat_timeout", "10"]
  log0 = open(tmp_path / "process0.log", "w")
  first = subprocess.Popen(cmd + ["--process_id", "0"], cwd=ROOT, env=env, stdout=log0,
                           stderr=subprocess.STDOUT, text=True)
  second = subprocess.Popen(cmd + ["--process_id", "1"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  for line in second.stdout:  # Past the checkpoint of step 4.
    lines.append(line)
    if "] [6] steps_per_sec" in line:
      break
  else:
    first.kill()
    raise AssertionError("".join(lines[-40:]))
  second.kill()
  second.communicate()
  first.wait(timeout=120)
  out = (tmp_path / "process0.log").read_text()
  assert first.returncode == 1, out[-3000:]
  assert "Traceback" not in out and "Fatal Python error" not in out, out[-3000:]
  last = out.strip().splitlines()[-1]
  said = re.fullmatch(r"error: process 1 of 2 stopped \(.+\); run the same command on every host "
                      r"to resume from the checkpoint of step (\d+)", last)
  assert said, last
  step = int(said[1])
  assert step >= 4 and str(step) in {p.name for p in (workdir / "checkpoints").iterdir()}
