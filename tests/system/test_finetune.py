"""Fine-tuning (run.init_from): a Multi30k smoke run starting from the trained fra-eng smoke run's
parameters, with its tokenizer and a fresh optimizer state; another model is refused before
anything is written."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.conftest import DATA, ROOT
from transformer_jax import sharding
from transformer_jax.models import build
from transformer_jax.training import checks
from transformer_jax.training import finetune, steps as step_lib, trainer
from transformer_jax.training.finetune import InitFromError
from transformer_jax.models.transformer import Transformer
from transformer_jax.decoding.translator import Translator
from transformer_jax.runs.restore import open_run
from transformer_jax.runs.workdir import Workdir


@pytest.fixture
def finetune_config(trained, tfds_dir, cache_dir):
  """configs/multi30k.py:smoke, starting from the trained fra-eng smoke run."""
  from configs import multi30k
  _, source = trained
  config = multi30k.get_config("smoke")
  config.data.update(data_dir=str(DATA / "multi30k"), tfds_dir=tfds_dir, num_workers="0")
  config.eval.bleu_sentences = 0
  config.run.update(compilation_cache_dir=str(cache_dir), init_from=str(source))
  return config


def _equal_trees(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_state_at_step_0_has_the_other_runs_parameters_and_a_fresh_optimizer(
    trained, finetune_config):
  _, source = trained
  cfg = checks.validated(finetune_config)
  opened = open_run(Workdir(source))
  model = Transformer(build.model_config(cfg.model, opened.tokenizers.src.vocab_size,
                                            opened.tokenizers.tgt.vocab_size))
  mesh = sharding.make_mesh(cfg.run.mesh_shape)
  fresh, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(cfg.optimizer, cfg.run.num_steps), cfg.run.seed, mesh,
      cfg.data.max_len)
  state = finetune.start_from(fresh, finetune.check_source(cfg, str(source)), model, mesh,
                              shardings)
  # The source kept a moving average (ema_decay 0.9): that is what it decodes with, and what
  # the new run starts from.
  wanted = Translator(source).params
  assert _equal_trees(state.params, wanted)
  assert not _equal_trees(fresh.params, wanted)
  assert int(state.step) == 0 and state.ema_params is None
  assert _equal_trees(state.opt_state, fresh.opt_state)


def test_a_fine_tuning_run_trains_from_the_other_run_with_its_tokenizer(trained, finetune_config,
                                                                        tmp_path):
  _, source = trained
  # One step whose learning rate is 0 (the warmup's first): the parameters stay the source's.
  finetune_config.run.update(num_steps=1, checkpoint_every=1)
  workdir = tmp_path / "ft"
  state = trainer.train_and_evaluate(finetune_config, str(workdir))
  assert (workdir / "tokenizer.model").read_bytes() == (source / "tokenizer.model").read_bytes()
  assert _equal_trees(state.params, Translator(source).params)
  assert int(state.step) == 1
  counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
            if "count" in jax.tree_util.keystr(path)]
  assert counts and all(int(c) == 1 for c in counts)  # The source's optimizer was at 20.
  # A second run of the same command resumes its own checkpoint: init_from is not read again.
  finetune_config.run.update(num_steps=2, init_from=str(tmp_path / "gone"))
  state = trainer.train_and_evaluate(finetune_config, str(workdir))
  assert int(state.step) == 2


@pytest.mark.parametrize("change, message", [
    ({"data.vocab_size": 400}, "data.vocab_size is 400 here and 500 there"),
    ({"model.d_model": 64}, "model.d_model is 64 here and 32 there"),
    ({"model.num_decoder_layers": 3, "model.ffn_dim": 128},
     "model.ffn_dim is 128 here and 64 there; model.num_decoder_layers is 3 here and 2 there"),
])
def test_another_model_is_refused_before_anything_is_written(finetune_config, tmp_path, change,
                                                             message):
  for key, value in change.items():
    section, field = key.split(".")
    finetune_config[section][field] = value
  workdir = tmp_path / "ft"
  with pytest.raises(InitFromError, match="is another model: " + message):
    trainer.train_and_evaluate(finetune_config, str(workdir))
  assert not workdir.exists()


def test_init_from_a_directory_that_is_no_run_is_a_one_line_error(finetune_config, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  c = finetune_config
  result = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/multi30k.py:smoke,finetune",
       "--workdir", str(tmp_path / "ft"), f"--config.data.data_dir={c.data.data_dir}",
       f"--config.data.tfds_dir={c.data.tfds_dir}", f"--config.run.init_from={tmp_path}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: run.init_from={str(tmp_path)!r} holds no config.json: not a training workdir or "
      "a Hugging Face checkpoint")
  assert not (tmp_path / "ft").exists()
