"""Two processes on localhost, two fake CPU devices each: one 4-device data-parallel run."""

import json
import os
import subprocess
import sys

import portpicker

from tests.conftest import DATA, ROOT


def test_two_process_training_run(tmp_path, tfds_dir, fra_eng_builder):
  port = portpicker.pick_unused_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen(
      [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
       "--workdir", str(tmp_path / "w"), f"--config.data_dir={DATA / 'fra-eng'}",
       f"--config.tfds_dir={tfds_dir}", "--config.num_steps=10", "--config.mesh_shape=(4,1,1)",
       "--config.num_bleu_sentences=16", "--coordinator_address", f"127.0.0.1:{port}",
       "--num_processes", "2", "--process_id", str(i)],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  # Both processes computed the same global evaluation over the 4 devices.
  evals = [[line.split("] ", 1)[1] for line in log.splitlines() if "eval/loss=" in line]
           for log in logs]
  assert evals[0] and evals[0] == evals[1]
  # Only process 0 writes metrics; every process saved its own data-iterator position.
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "eval/loss" in r] == [10]
  data = tmp_path / "w" / "checkpoints" / "10" / "data"
  assert (data / "process_0-of-2.json").exists() and (data / "process_1-of-2.json").exists()
