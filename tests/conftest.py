"""Shared fixtures: the real corpora (in $TRANSFORMER_JAX_DATA, default data/, where
`python -m transformer_jax download --out data` puts them), prepared once per session with tfds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # train.py and configs/ live at the repository root.
DATA = Path(os.environ.get("TRANSFORMER_JAX_DATA", ROOT / "data")).resolve()


def pytest_sessionstart(session):
  """The tests train and translate on the real corpora: without them, one line saying where."""
  if not (DATA / "fra-eng").is_dir():
    raise pytest.UsageError(
        f"no corpora in {DATA}: run `python -m transformer_jax download --out data`, or set "
        "TRANSFORMER_JAX_DATA to a directory that holds fra-eng/, multi30k/, en-fr-test/ and "
        "shakespeare/")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
  """One persistent compilation cache for the train.py processes the tests start (the same
  smoke programs compile once)."""
  return tmp_path_factory.mktemp("jax_cache")


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
  from transformer_jax.models.transformer import TransformerConfig
  kwargs = dict(src_vocab_size=128, tgt_vocab_size=128, d_model=32, num_heads=4, ffn_dim=64,
                num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                share_embeddings=False, tie_output=False, attention_impl="xla")
  kwargs.update(overrides)
  return TransformerConfig(**kwargs)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tfds_dir, cache_dir, fra_eng_builder):
  """A 20-step smoke run with checkpoints 10 and 20, keeping a moving average of the parameters
  whatever the recipe does (tests copy it before changing it)."""
  from transformer_jax.training import trainer
  from configs import fra_eng
  config = fra_eng.get_config("smoke")
  config.data.update(data_dir=str(DATA / "fra-eng"), tfds_dir=tfds_dir, num_workers="0")
  config.eval.bleu_sentences = 0
  config.run.compilation_cache_dir = str(cache_dir)
  config.step.ema_decay = 0.9
  workdir = tmp_path_factory.mktemp("trained")
  trainer.train_and_evaluate(config, str(workdir))
  return config, workdir
