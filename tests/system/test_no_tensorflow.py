"""train.py and translate where TensorFlow is not installed (as on the GPU machine).

The subprocesses run with `python -S` and a copy of this environment's site-packages made of
links, without TensorFlow, TensorBoard and Keras: tfds prepares and reads the dataset, grain
workers pack, and the events go through tensorboardX.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import DATA, ROOT

ABSENT = {"tensorflow", "tensorflow_cpu", "tensorboard", "tensorboard_data_server", "keras",
          "tf_keras"}


def _site_without_tensorflow(directory: Path) -> Path:
  site = Path(sysconfig.get_paths()["purelib"])
  directory.mkdir()
  for entry in site.iterdir():
    if entry.name.split("-")[0].lower() not in ABSENT:
      (directory / entry.name).symlink_to(entry)
  return directory


def _scalar_tags(events_file: Path) -> set[str]:
  """Tags of the scalar summaries in a TensorBoard events file (TFRecord framing)."""
  from tensorboardX.proto import event_pb2
  data, tags, pos = events_file.read_bytes(), set(), 0
  while pos < len(data):
    (length,) = struct.unpack("<Q", data[pos:pos + 8])
    event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
    tags.update(v.tag for v in event.summary.value if v.HasField("simple_value"))
    pos += 12 + length + 4
  return tags


def test_train_and_translate_run_without_tensorflow(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(_site_without_tensorflow(tmp_path / "site")),
             JAX_PLATFORMS="cpu")
  python = [sys.executable, "-S"]
  probe = subprocess.run(python + ["-c", "import tensorflow"], env=env, capture_output=True,
                         text=True)
  assert probe.returncode != 0 and "No module named 'tensorflow'" in probe.stderr

  workdir = tmp_path / "run"
  train = subprocess.run(
      python + ["train.py", "--config", "configs/fra_eng.py:smoke", "--workdir", str(workdir),
                f"--config.data.data_dir={DATA / 'fra-eng'}",
                f"--config.data.tfds_dir={tmp_path / 'tfds'}", "--config.run.num_steps=3",
                "--config.run.log_every=1", "--config.data.num_workers=1",
                "--config.eval.bleu_sentences=8"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-4000:]
  # The grain worker's batches are freed before exit (the resource tracker once warned).
  assert "leaked" not in train.stderr and "Exception ignored" not in train.stderr
  # Prepared without TensorFlow too (under tfds/local-DIGEST: a local corpus).
  assert list((tmp_path / "tfds").glob("local-*/fra_eng/*/dataset_info.json"))
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().split("\n")
           if line and "train/loss" in line]
  assert steps == [1, 2, 3]
  (events,) = workdir.glob("events.out.tfevents.*")
  assert {"train/loss", "eval/loss", "eval/bleu"} <= _scalar_tags(events)

  translate = subprocess.run(
      python + ["-m", "transformer_jax", "translate", "--workdir", str(workdir), "I lost."],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert translate.returncode == 0, translate.stderr[-3000:]
  assert "Restored step 3" in translate.stderr
  assert len(translate.stdout.splitlines()) == 1
