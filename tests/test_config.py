import subprocess
import sys

import pytest

from tests.conftest import ROOT
from transformer_jax.workdir import Workdir
from transformer_jax.workdir import WorkdirError
from transformer_jax import config as config_lib, sections, workdir as workdir_lib

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


@pytest.mark.parametrize("name", ["fra_eng", "d2l_tiny", "multi30k", "wmt14_base", "wmt14_big"])
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_every_config_validates(name, arg):
  module = __import__(f"configs.{name}", fromlist=["get_config"])
  config = module.get_config(arg)
  config_lib.validate(config)
  model = sections.model_config(config, 1000, 1000)
  assert model.tgt_vocab_size == 1024  # Padded to a multiple of 128.


def test_d2l_tiny_has_the_chapters_settings():
  from configs import d2l_tiny
  c = d2l_tiny.get_config()
  assert (c.max_len, c.batch_size, c.learning_rate, c.grad_clip) == (9, 128, 1e-3, 1.0)
  assert (c.model.num_encoder_layers, c.model.d_model, c.model.ffn_dim, c.model.num_heads,
          c.model.dropout_rate) == (2, 256, 64, 4, 0.2)
  assert c.num_steps * c.batch_size == 30 * 512 and c.train_split == "train[:512]"


@pytest.mark.parametrize("field,value,message", [
    ("dataset", "nope", "dataset='nope' is unknown"),
    ("data_dir", "/does/not/exist", "data_dir='/does/not/exist' is not a directory"),
    ("schedule", "linear", "schedule='linear' must be one of"),
    ("mesh_shape", (1, 1), "mesh_shape=(1, 1) must have 3 entries"),
])
def test_bad_fields_are_named(field, value, message):
  from configs import fra_eng
  config = fra_eng.get_config()
  config[field] = value
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    sections.validated(config)


def test_train_py_fails_in_one_line_before_compiling(tmp_path):
  result = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/fra_eng.py:smoke",
       "--workdir", str(tmp_path / "w"), "--config.model.d_model=30"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "error: model.d_model=30 is not divisible by model.num_heads=4")
  assert not (tmp_path / "w").exists()  # Nothing half-written.


def test_a_workdir_of_another_model_is_refused():
  from configs import fra_eng
  saved = fra_eng.get_config("smoke")
  workdir_lib.check_same_model(saved.to_json(), saved)  # Same model: fine.
  scanned = fra_eng.get_config("smoke")
  scanned.model.scan_layers = True
  scanned.vocab_size = 300
  with pytest.raises(config_lib.ConfigError, match="model.scan_layers, vocab_size differ"):
    workdir_lib.check_same_model(saved.to_json(), scanned)
  averaged = fra_eng.get_config("smoke")
  averaged.ema_decay = 0.0 if saved.ema_decay else 0.99  # Checkpoints with(out) an average.
  with pytest.raises(config_lib.ConfigError, match="ema_decay differ"):
    workdir_lib.check_same_model(saved.to_json(), averaged)
  averaged.ema_decay, saved.ema_decay = 0.99, 0.999  # Another decay: the same checkpoints.
  workdir_lib.check_same_model(saved.to_json(), averaged)


def test_resuming_with_other_learning_rates_is_logged(tmp_path, caplog):
  from configs import fra_eng
  config = fra_eng.get_config("smoke")
  assert config.schedule == "cosine" and config.num_steps == 20
  (tmp_path / "checkpoints" / "10").mkdir(parents=True)
  (tmp_path / "config.json").write_text(config.to_json())
  caplog.set_level("WARNING")
  Workdir(str(tmp_path)).check_resumable(config)  # The same command: nothing to say.
  config.grad_clip = 0.5  # Not a learning rate.
  Workdir(str(tmp_path)).check_resumable(config)
  assert "learning rates" not in caplog.text
  config.num_steps = 40  # The cosine now decays over 40 steps.
  Workdir(str(tmp_path)).check_resumable(config)
  assert ("num_steps=40 (the run's: 20), grad_clip=0.5 (the run's: 1.0): the learning rates "
          "from the checkpoint of step 10 on are not the ones the run was following"
          ) in caplog.text
  caplog.clear()
  saved = fra_eng.get_config("smoke")
  saved.schedule = "rsqrt"  # Does not span num_steps: extending the run changes nothing.
  (tmp_path / "config.json").write_text(saved.to_json())
  config = fra_eng.get_config("smoke")
  config.schedule, config.num_steps = "rsqrt", 40
  Workdir(str(tmp_path)).check_resumable(config)
  assert "learning rates" not in caplog.text
  config.learning_rate *= 2
  Workdir(str(tmp_path)).check_resumable(config)
  assert "learning_rate=0.002 (the run's: 0.001)" in caplog.text


def test_a_damaged_config_json_of_a_resumed_run_is_one_error(tmp_path):
  from configs import fra_eng
  (tmp_path / "checkpoints" / "10").mkdir(parents=True)
  (tmp_path / "config.json").write_text('{"dataset": "fra_')  # Cut short.
  with pytest.raises(WorkdirError, match=r"config.json is damaged \(Unterminated"):
    Workdir(str(tmp_path)).check_resumable(fra_eng.get_config("smoke"))
