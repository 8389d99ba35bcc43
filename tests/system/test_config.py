import dataclasses
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from transformer_jax import config as config_lib
from transformer_jax.models import build
from transformer_jax.training import checks
from transformer_jax.training.resume import check_resumable, check_same_model
from transformer_jax.runs.workdir import Workdir, WorkdirError

pytestmark = pytest.mark.quick  # In the edit-loop subset: pytest -m quick.


@pytest.mark.parametrize("name", ["fra_eng", "d2l_tiny", "multi30k", "wmt14_base", "wmt14_big"])
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_every_config_validates(name, arg):
  module = __import__(f"configs.{name}", fromlist=["get_config"])
  config = module.get_config(arg)
  cfg = config_lib.validate(config)
  model = build.model_config(cfg.model, 1000, 1000)
  assert model.tgt_vocab_size == 1024  # Padded to a multiple of 128.


@pytest.mark.parametrize("arg, message", [
    (None, "needs the checkpoint's directory: configs/huggingface_shakespeare.py:CHECKPOINT"),
    ("smoke", "configs/huggingface_shakespeare.py:smoke names no checkpoint: its smoke run is "
     "configs/huggingface_shakespeare.py:CHECKPOINT,smoke")])
def test_the_hugging_face_config_without_a_checkpoint_says_how_to_name_one(arg, message):
  from configs import huggingface_shakespeare
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    huggingface_shakespeare.get_config(arg)


def test_d2l_tiny_has_the_chapters_settings():
  from configs import d2l_tiny
  c = d2l_tiny.get_config()
  assert (c.data.max_len, c.data.batch_size, c.optimizer.learning_rate,
          c.optimizer.grad_clip) == (9, 128, 1e-3, 1.0)
  assert (c.model.num_encoder_layers, c.model.d_model, c.model.ffn_dim, c.model.num_heads,
          c.model.dropout_rate) == (2, 256, 64, 4, 0.2)
  assert (c.model.attention_bias, c.model.layer_norm_eps) == (False, 1e-5)  # d2l's PyTorch.
  assert c.run.num_steps * c.data.batch_size == 30 * 512 and c.data.train_split == "train[:512]"


@pytest.mark.parametrize("field,value,message", [
    ("data.dataset", "nope", "data.dataset='nope' is unknown"),
    ("optimizer.schedule", "linear", "optimizer.schedule='linear' must be one of"),
    ("optimizer.name", "lion", "optimizer.name='lion' must be one of adamw, muon, "
     "schedule_free_adamw"),
    ("optimizer.name", "schedule_free_adamw", "optimizer.name='schedule_free_adamw' follows no "
     "schedule: set optimizer.schedule='constant' (it warms up over optimizer.warmup_steps), "
     "not 'cosine'"),
    ("optimizer.muon_beta", 1.0, "optimizer.muon_beta=1.0 must be in "),
    ("optimizer.decay_fraction", 0.0, "optimizer.decay_fraction=0.0 must be in (0, 1]"),
    ("model.layer_norm_eps", 0.0, "model.layer_norm_eps=0.0 must be in (0, 1)"),
    ("run.mesh_shape", (1, 1), "run.mesh_shape=(1, 1) must have 3 entries"),
    ("run.mesh_shape", (0, 1, 1), "run.mesh_shape=(0, 1, 1): each entry must be a device count "
     "of at least 1, or -1 (the devices left)"),
    ("step.grad_accum_steps", 5, "step.grad_accum_steps=5 must divide data.batch_size=36"),
    ("model.attention_mask", "lengths", "model.attention_mask='lengths' takes one sequence a "
     "row: set data.packing=False"),
    ("model.attention_mask", "dense", "model.attention_mask='dense' must be segments or lengths"),
    ("data.train_fraction", 0.0, "data.train_fraction=0.0 must be in (0, 1]"),
    ("data.train_fraction", 0.5, "data.train_fraction=0.5 picks labelled texts; "
     "data.dataset='fra_eng' holds sentence pairs: leave it at 1.0"),
    ("step.masking", "spans", "step.masking='spans' must be 'pieces' or 'words'"),
    ("step.mask_rate", 1.0, "step.mask_rate=1.0 must be in (0, 1)"),
])
def test_bad_fields_are_named(field, value, message):
  from configs import fra_eng
  config = fra_eng.get_config()
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    checks.validated(config)


@pytest.mark.parametrize("field,value,message", [
    ("data.data_dir", "/does/not/exist", "data.data_dir='/does/not/exist' is not a directory: "
     "pass the corpus's directory with --config.data.data_dir DIR"),
    ("data.data_dir", "data/moved", "data.data_dir='data/moved' is not a directory from "),
    ("run.compiled_train_step", "/does/not/exist.bin",
     "run.compiled_train_step='/does/not/exist.bin' is not a file"),
])
def test_paths_are_the_trainers_to_check_not_the_configs(field, value, message):
  """A path a run reads is checked by the trainer before it starts; parsing a config (as every
  command that reads a trained run's config.json does) reads no disk, so a moved run parses."""
  from configs import fra_eng
  config = fra_eng.get_config()
  section, name = field.split(".")
  config[section][name] = value
  cfg = checks.validated(config)
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    checks.check_paths(cfg)


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
  check_same_model(config_lib.parse(saved), config_lib.parse(saved))  # Same model: fine.
  scanned = fra_eng.get_config("smoke")
  scanned.model.scan_layers = True
  scanned.data.vocab_size = 300
  with pytest.raises(config_lib.ConfigError,
                     match=r"another model: model.scan_layers=True \(its config.json: False\), "
                           r"data.vocab_size=300 \(its config.json: \d+\)$"):
    check_same_model(config_lib.parse(saved), config_lib.parse(scanned))
  averaged = fra_eng.get_config("smoke")
  averaged.step.ema_decay = 0.0 if saved.step.ema_decay else 0.99  # With(out) an average.
  with pytest.raises(config_lib.ConfigError, match=r"step.ema_decay=.* \(its config.json: .*\)$"):
    check_same_model(config_lib.parse(saved), config_lib.parse(averaged))
  averaged.step.ema_decay, saved.step.ema_decay = 0.99, 0.999  # Another decay: same checkpoints.
  check_same_model(config_lib.parse(saved), config_lib.parse(averaged))
  sorted_grad = fra_eng.get_config("smoke")  # Another embedding gradient: same parameters.
  sorted_grad.model.embed_grad = "sorted"
  check_same_model(config_lib.parse(fra_eng.get_config("smoke")), config_lib.parse(sorted_grad))
  computed = fra_eng.get_config("smoke")  # How it is computed, and dropout: same parameters.
  computed.model.update(remat="full", attention_impl="xla", dropout_rate=0.3)
  check_same_model(config_lib.parse(fra_eng.get_config("smoke")), config_lib.parse(computed))


def test_resuming_with_other_learning_rates_is_logged(tmp_path, caplog):
  from configs import fra_eng
  config = fra_eng.get_config("smoke")
  assert config.optimizer.schedule == "cosine" and config.run.num_steps == 20
  (tmp_path / "checkpoints" / "10").mkdir(parents=True)
  (tmp_path / "config.json").write_text(config.to_json())
  caplog.set_level("WARNING")
  check_resumable(Workdir(str(tmp_path)), config_lib.parse(config))  # The same command: fine.
  config.optimizer.grad_clip = 0.5  # Not a learning rate.
  check_resumable(Workdir(str(tmp_path)), config_lib.parse(config))
  assert "learning rates" not in caplog.text
  config.run.num_steps = 40  # The cosine now decays over 40 steps.
  check_resumable(Workdir(str(tmp_path)), config_lib.parse(config))
  assert ("run.num_steps=40 (the run's: 20), optimizer.grad_clip=0.5 (the run's: 1.0): the "
          "learning rates "
          "from the checkpoint of step 10 on are not the ones the run was following"
          ) in caplog.text
  caplog.clear()
  saved = fra_eng.get_config("smoke")
  saved.optimizer.schedule = "rsqrt"  # Does not span num_steps: extending it changes nothing.
  (tmp_path / "config.json").write_text(saved.to_json())
  config = fra_eng.get_config("smoke")
  config.optimizer.schedule, config.run.num_steps = "rsqrt", 40
  check_resumable(Workdir(str(tmp_path)), config_lib.parse(config))
  assert "learning rates" not in caplog.text
  config.optimizer.learning_rate *= 2
  check_resumable(Workdir(str(tmp_path)), config_lib.parse(config))
  assert "optimizer.learning_rate=0.002 (the run's: 0.001)" in caplog.text


def test_a_damaged_config_json_of_a_resumed_run_is_one_error(tmp_path):
  from configs import fra_eng
  (tmp_path / "checkpoints" / "10").mkdir(parents=True)
  (tmp_path / "config.json").write_text('{"dataset": "fra_')  # Cut short.
  with pytest.raises(WorkdirError, match=r"config.json is damaged \(Unterminated"):
    check_resumable(Workdir(str(tmp_path)), config_lib.parse(fra_eng.get_config("smoke")))


def test_each_section_is_the_dataclass_its_subsystem_uses():
  from transformer_jax.data import pipeline
  from transformer_jax.models import common as model_lib
  from transformer_jax.training import steps as step_lib
  assert pipeline.DataConfig is config_lib.DataConfig
  assert step_lib.OptimizerConfig is config_lib.OptimizerConfig
  assert step_lib.StepConfig is config_lib.StepConfig
  assert issubclass(model_lib.TransformerConfig, config_lib.ModelConfig)
  # base_config is the dataclasses' defaults, section by section and field by field.
  assert config_lib.base_config().to_dict() == config_lib.Config().to_dict()
  assert set(config_lib.Config().to_dict()) == {
      "data", "model", "optimizer", "step", "eval", "run", "decode"}


def test_a_section_checks_its_own_fields():
  with pytest.raises(config_lib.ConfigError, match=r"^eval.every=0 must be a positive integer$"):
    config_lib.EvalConfig(every=0)
  with pytest.raises(config_lib.ConfigError, match=r"^model.remat='some' must be none, full"):
    config_lib.ModelConfig(remat="some")
  with pytest.raises(config_lib.ConfigError,
                     match=r"^model.embed_grad='gather' must be auto, scatter, onehot or sorted$"):
    config_lib.ModelConfig(embed_grad="gather")
  config = config_lib.base_config()
  config.data.bogus = 1
  with pytest.raises(config_lib.ConfigError,
                     match=r"^data.bogus is not a field of the data section$"):
    config_lib.parse(config)


def test_a_flat_config_json_of_an_older_run_is_read_in_sections(tmp_path):
  from configs import fra_eng
  cfg = config_lib.parse(fra_eng.get_config("smoke"))
  flat = {k: v for section in cfg.to_dict().values() for k, v in section.items()
          if k not in ("every", "batch_size", "num_batches", "bleu_sentences")}
  flat.update(model=cfg.to_dict()["model"], batch_size=cfg.data.batch_size,
              eval_every=cfg.eval.every, eval_batch_size=cfg.eval.batch_size,
              num_bleu_sentences=cfg.eval.bleu_sentences, num_eval_batches=-1,
              removed_since=1)
  for name in ("beam_size", "alpha", "segment_over", "long_beam_size", "long_over"):
    del flat[name]  # A run older than the decode section: base_config's.
  (tmp_path / "config.json").write_text(json.dumps(flat))
  loaded = Workdir(tmp_path).load_config()
  assert loaded == dataclasses.replace(cfg, decode=config_lib.DecodeConfig())


def test_a_runs_config_is_read_once_a_process_until_its_file_changes(tmp_path):
  """A command opens its run in several places (flags' checks, the runner, the server): one
  parse of config.json, shared, and a new one once the file is replaced."""
  from configs import fra_eng
  from transformer_jax.runs.workdir import Workdir
  run = Workdir(tmp_path / "w")
  run.write_config(config_lib.parse(fra_eng.get_config("smoke")))
  first = Workdir(tmp_path / "w").load_config()
  assert Workdir(str(tmp_path / "w")).load_config() is first
  run.write_config(dataclasses.replace(
      first, decode=dataclasses.replace(first.decode, beam_size=7)))
  again = Workdir(tmp_path / "w").load_config()
  assert again is not first and again.decode.beam_size == 7


def test_a_run_resumed_with_another_optimizer_is_refused():
  from configs import fra_eng
  from transformer_jax.training import resume
  saved = config_lib.parse(fra_eng.get_config())
  assert saved.optimizer.name == "muon"  # The main job's.
  changed = fra_eng.get_config()
  changed.optimizer.name = "adamw"
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "the workdir's checkpoints are of another model: optimizer.name='adamw' (its config.json: "
      "'muon')")):
    resume.check_same_model(saved, config_lib.parse(changed))
