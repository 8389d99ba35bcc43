"""Exports of a trained smoke workdir: CTranslate2's greedy outputs equal ours; the jax.export
decoders translate in a fresh process that imports no model code."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests import exported
from tests.conftest import DATA, ROOT
from transformer_jax.decoding import generation
from transformer_jax.interop import jax_export
from transformer_jax.data.tokenizer import BOS, EOS, PAD
from transformer_jax.decoding.generation import encode_sources, strip
from transformer_jax.decoding.options import DecodeOptions
from transformer_jax.decoding.inputs import split_pairs
from transformer_jax.decoding.translator import Translator


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "export", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def validation(trained):
  _, workdir = trained
  sources, _ = split_pairs(str(workdir), "validation[:96]")
  return sources


def test_ctranslate2_greedy_outputs_equal_ours_on_the_validation_split(trained, validation,
                                                                       tmp_path):
  ctranslate2 = pytest.importorskip("ctranslate2")  # The `export` extra; the tests install it.
  _, workdir = trained
  result = _cli("--workdir", str(workdir), "--to", "ctranslate2", str(tmp_path / "ct2"))
  assert result.returncode == 0, result.stderr[-2000:]
  assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer.model"} <= {
      p.name for p in (tmp_path / "ct2").iterdir()}
  assert not list(tmp_path.glob(".ct2.partial-*"))

  translator = Translator(workdir)
  src = encode_sources(translator.tokenizers.src, validation, translator.max_src_len)
  max_len = src.shape[1] + 10
  ours = translator.decode(src, DecodeOptions(max_len=max_len))[0][:, 0]
  engine = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=2)
  pieces = translator.tokenizers.tgt.pieces()
  sources = [[pieces[i] for i in row if i > 0][:-1] for row in src]  # Without <eos>.
  results = engine.translate_batch(sources, beam_size=1, max_decoding_length=max_len)
  theirs = [[pieces.index(p) for p in r.hypotheses[0]] for r in results]
  assert theirs == [strip(row) for row in ours]
  # The same function, not only the same argmax: CTranslate2's log-probabilities of our
  # outputs (<eos> included) equal the model's.
  scored = engine.score_batch(sources, [[pieces[i] for i in strip(row)] for row in ours])
  tgt = np.array([strip(row) + [EOS] + [PAD] * (max_len - len(strip(row))) for row in ours])
  logp = np.asarray(generation.sequence_logprob(translator.model, translator.params, src, tgt))
  np.testing.assert_allclose([sum(r.log_probs) for r in scored], logp, rtol=1e-4, atol=1e-3)

  # Stored as int8: loads and translates every source (int8 rounding may change outputs).
  result = _cli("--workdir", str(workdir), "--to", "ctranslate2", "--quantization", "int8",
                str(tmp_path / "ct2_int8"))
  assert result.returncode == 0, result.stderr[-2000:]
  int8 = ctranslate2.Translator(str(tmp_path / "ct2_int8"), device="cpu", compute_type="int8")
  assert len(int8.translate_batch(sources, beam_size=1, max_decoding_length=max_len)) == len(src)

  # With CTranslate2's own default limits (outputs up to 256 tokens, inputs up to 1024): the
  # position table reaches them (the smoke model's outputs run to the limit, repeating).
  ct2_module = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
  long_source = [pieces[4 + i % 100] for i in range(1000)]
  results = ct2_module.translate_batch(sources[:4] + [long_source])
  assert len(results) == 5
  assert max(len(r.hypotheses[0]) for r in results) > 4 * translator.max_src_len


def test_an_exported_jax_decoder_translates_in_a_process_without_the_model_code(
    trained, validation, tmp_path):
  _, workdir = trained
  out = tmp_path / "jax"
  result = _cli("--workdir", str(workdir), "--to", "jax", "--beam_size", "3", "--alpha", "0.6",
                str(out))
  assert result.returncode == 0, result.stderr[-2000:]
  manifest = json.loads((out / "export.json").read_text())
  assert sorted({p["beam_size"] for p in manifest["programs"]}) == [1, 3]

  # A fresh interpreter given only the exported directory and the runner module.
  runner = tmp_path / "runner"
  runner.mkdir()
  (runner / "transformer_jax" / "interop").mkdir(parents=True)
  # The packages' __init__ files import nothing.
  for name in ("__init__.py", "interop/__init__.py", "interop/jax_export.py"):
    shutil.copy(ROOT / "transformer_jax" / name, runner / "transformer_jax" / name)
  sentences = validation[:24]
  script = (
      "import json, sys\n"
      "from transformer_jax.interop.jax_export import ExportedTranslator\n"
      f"t = ExportedTranslator({str(out)!r})\n"
      f"lines = {sentences!r}\n"
      "out = {'greedy': t.translate(lines), 'beam': t.translate(lines, beam=True),\n"
      "       'modules': sorted(m for m in sys.modules if m.split('.')[0] in\n"
      "                         ('flax', 'optax', 'orbax', 'transformer_jax'))}\n"
      "print(json.dumps(out))\n")
  done = subprocess.run([sys.executable, "-c", script], cwd=runner, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  got = json.loads(done.stdout.splitlines()[-1])
  assert got["modules"] == ["transformer_jax", "transformer_jax.interop",
                            "transformer_jax.interop.jax_export"]

  translator = Translator(workdir)
  width = jax_export.source_widths(translator.max_src_len)[0]
  src = encode_sources(translator.tokenizers.src, sentences, translator.max_src_len, width=width)
  for key, beam in (("greedy", 1), ("beam", 3)):
    tokens = translator.decode(src, DecodeOptions(beam_size=beam, alpha=0.6,
                                                  max_len=width + 10))[0][:, 0]
    assert got[key] == [translator.tokenizers.tgt.decode(strip(row)) for row in tokens], key


def test_bad_exports_are_one_line_errors_that_write_nothing(trained, tmp_path):
  _, workdir = trained
  (tmp_path / "taken").mkdir()
  cases = [
      (["--to", "jax", str(tmp_path / "taken")], "exists; name a new directory"),
      (["--to", "jax", "--quantization", "int8", str(tmp_path / "a")],
       "--quantization applies to --to ctranslate2 only"),
      (["--to", "jax", str(tmp_path / "b"), str(tmp_path / "c")], "name one output directory"),
      (["--to", "jax", "--beam_size", "0", str(tmp_path / "d")], "--beam_size must be at least 1"),
      (["--to", "ctranslate2", "--quantization", "int3", str(tmp_path / "f")],
       "--quantization 'int3': choose one of int8,"),
  ]
  for args, message in cases:
    result = _cli("--workdir", str(workdir), *args)
    assert result.returncode == 1, (args, result.stderr[-1000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, (args, last)
    assert "Traceback" not in result.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
  missing = _cli("--workdir", str(tmp_path / "none"), "--to", "jax", str(tmp_path / "e"))
  assert missing.returncode == 1 and "holds no config.json" in missing.stderr


def _copy_with_model_field(workdir, to, name, value):
  """A copy of a workdir whose config.json sets model.NAME to `value` (None: removes it, as in a
  config.json written before the field existed)."""
  shutil.copytree(workdir, to)
  saved = json.loads((to / "config.json").read_text())
  saved["model"].pop(name)
  if value is not None:
    saved["model"][name] = value
  (to / "config.json").write_text(json.dumps(saved))
  return to


def test_the_ctranslate2_export_uses_the_models_layer_norm_eps(trained, validation, tmp_path):
  """The same weights run with epsilon 1e-5 and 0.5 (large enough that a wrong epsilon shows
  over float tolerance): CTranslate2's log-probabilities of our outputs equal ours for each."""
  ctranslate2 = pytest.importorskip("ctranslate2")
  _, workdir = trained
  scores = {}
  for eps in (1e-5, 0.5):
    copy = _copy_with_model_field(workdir, tmp_path / f"run_{eps}", "layer_norm_eps", eps)
    result = _cli("--workdir", str(copy), "--to", "ctranslate2", str(tmp_path / f"ct2_{eps}"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / f"ct2_{eps}" / "config.json").read_text())[
        "layer_norm_epsilon"] == eps
    translator = Translator(copy)
    assert translator.model.cfg.layer_norm_eps == eps
    src = encode_sources(translator.tokenizers.src, validation[:32], translator.max_src_len)
    max_len = src.shape[1] + 10
    ours = translator.decode(src, DecodeOptions(max_len=max_len))[0][:, 0]
    tgt = np.array([strip(row) + [EOS] + [PAD] * (max_len - len(strip(row))) for row in ours])
    logp = np.asarray(generation.sequence_logprob(translator.model, translator.params, src, tgt))
    pieces = translator.tokenizers.tgt.pieces()
    engine = ctranslate2.Translator(str(tmp_path / f"ct2_{eps}"), device="cpu")
    scored = engine.score_batch([[pieces[i] for i in row if i > 0][:-1] for row in src],
                                [[pieces[i] for i in strip(row)] for row in ours])
    scores[eps] = [sum(r.log_probs) for r in scored]
    np.testing.assert_allclose(scores[eps], logp, rtol=1e-4, atol=1e-3)
  assert np.abs(np.subtract(scores[0.5], scores[1e-5])).max() > 0.1


def test_a_config_json_from_before_layer_norm_eps_reads_as_1e_6(trained, validation, tmp_path):
  _, workdir = trained
  old = _copy_with_model_field(workdir, tmp_path / "old", "layer_norm_eps", None)
  assert "layer_norm_eps" not in json.loads((old / "config.json").read_text())["model"]
  before, now = Translator(old), Translator(workdir)
  assert before.model.cfg.layer_norm_eps == 1e-6
  options = DecodeOptions(beam_size=4, alpha=0.6)
  assert before.translate(validation[:32], options) == now.translate(validation[:32], options)


def test_a_translation_model_exports_to_marian_with_the_same_ids_logits_and_greedy_outputs(
    trained, validation, tmp_path):
  import torch
  from transformers import AutoTokenizer, MarianMTModel
  _, workdir = trained
  out = tmp_path / "hf"
  exported.export(workdir, out)
  translator = Translator(workdir)
  ours = translator.tokenizers.src
  # The tokenizer: the Tatoeba test sources' ids, <eos> after each, as translate reads them.
  tatoeba = (DATA / "en-fr-test" / "tatoeba-test-v2021-08-07.disjoint-from-fra-eng.eng"
             ).read_text(encoding="utf-8").splitlines()
  theirs = AutoTokenizer.from_pretrained(out)
  assert theirs(tatoeba).input_ids == [ids + [EOS] for ids in ours.encode(tatoeba)]
  # Greedy outputs of 20 sources, and the logits of the batch (padded sources, padded targets).
  src = encode_sources(ours, validation[:20], translator.max_src_len)
  max_len = src.shape[1] + 10
  outputs = [strip(row) for row in translator.decode(src, DecodeOptions(max_len=max_len))[0][:, 0]]
  model = MarianMTModel.from_pretrained(out, dtype=torch.float32).eval()
  src_t = torch.from_numpy(src.astype(np.int64))
  generated = model.generate(input_ids=src_t, attention_mask=(src_t > 0).long(),
                             max_new_tokens=max_len, num_beams=1, do_sample=False).tolist()
  cut = lambda row: row[1:row.index(EOS)] if EOS in row else [t for t in row[1:] if t != PAD]
  assert [cut(row) for row in generated] == outputs
  # Without a length of its own, generate() may go on to the model's positions (not 20).
  assert model.generation_config.max_length == translator.model.cfg.max_len > 20
  decoder_in, mask = exported.padded([[BOS] + row for row in outputs])
  a = exported.our_outputs(workdir, src, decoder_in)
  with torch.no_grad():
    b = model(input_ids=src_t, attention_mask=(src_t > 0).long(),
              decoder_input_ids=torch.from_numpy(decoder_in),
              decoder_attention_mask=torch.from_numpy(mask)).logits.numpy()
  real = mask.astype(bool)
  assert np.max(np.abs(a[real] - b[real])) < 1e-4
