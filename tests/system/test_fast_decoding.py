"""int8 weights and the vocabulary shortlist, on the trained smoke model: what is quantized and
how closely it computes, the shortlist's table and file, and decoding over a shortlist against
decoding over the whole vocabulary."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import ROOT
from transformer_jax.data.tokenizer import EOS
from transformer_jax.decoding import shortlist
from transformer_jax.decoding.generation import encode_sources
from transformer_jax.decoding.inputs import split_pairs
from transformer_jax.decoding.options import DecodeOptions, InferenceError
from transformer_jax.decoding.translator import Translator, quantized
from transformer_jax.models import int8
from transformer_jax.models.transformer import Transformer


@pytest.fixture(scope="module")
def translator(trained):
  return Translator(trained[1])


@pytest.fixture(scope="module")
def rows(translator, trained):
  """30 validation sources of 16 tokens at most (one width class of slots: one decoder's
  programs to compile), as token ids with <eos>."""
  texts, _ = split_pairs(str(trained[1]), "validation")
  src = encode_sources(translator.tokenizers.src, texts, translator.max_src_len)
  rows = [row[row != 0] for row in src]
  rows = [row for row in rows if len(row) <= 16]
  return rows[::len(rows) // 30][:30]


def test_int8_quantizes_every_products_kernel_and_keeps_the_rest_float(translator):
  params = translator.params
  q = quantized(translator.config, params)
  flat = {"/".join(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(q)}
  original = {"/".join(k.key for k in path): leaf
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  kernels = [k for k in original if k.rsplit("/", 1)[-1] in int8.CONTRACTED
             and (not k.endswith("/kernel") or k.split("/")[-2] in ("wi", "wo"))]
  assert "src_embed/embedding" in kernels and any("/wi/kernel" in k for k in kernels)
  assert any("cross_attention/out_kernel" in k for k in kernels)
  for name, value in original.items():
    if name in kernels:
      values, scale = flat[name], flat[f"{name}_scale"]
      assert values.dtype == jnp.int8 and values.shape == value.shape
      axes = int8.CONTRACTED[name.rsplit("/", 1)[-1]]
      assert scale.shape == tuple(d for i, d in enumerate(value.shape) if i not in axes)
      back = values.astype(jnp.float32) * jnp.expand_dims(scale, axes)
      # Each weight within half a step of its channel's scale of what it was.
      assert jnp.all(jnp.abs(back - value) <= 0.5 * jnp.expand_dims(scale, axes) + 1e-7), name
    else:
      assert flat[name].dtype == value.dtype and jnp.array_equal(flat[name], value), name
  assert len(flat) == len(original) + len(kernels)


def test_an_int8_product_is_within_a_percent_of_float32s():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 64)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
  values, scale = int8._scaled(kernel, (0,))
  exact = x @ kernel
  got = int8.matmul(x, values, scale, contract=0)
  assert got.shape == exact.shape
  assert float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)) < 0.01
  # The same weights as rows [N, K] (a token table's layout).
  values_t, scale_t = int8._scaled(kernel.T, (1,))
  np.testing.assert_allclose(int8.matmul(x, values_t, scale_t, contract=1), got, rtol=1e-6,
                             atol=1e-6)


def test_int8_decoding_computes_the_float32_models_steps_closely(translator, trained, rows):
  model, params = translator.model, translator.params
  src = jnp.asarray(encode_sources(translator.tokenizers.src, ["I lost.", "He is at home."],
                                   translator.max_src_len))
  tgt = jnp.asarray([[1, 20, 30, 40], [1, 50, 60, 70]], jnp.int32)
  exact = model.apply({"params": params}, src, tgt)
  got = model.apply({"params": quantized(translator.config, params)}, src, tgt)
  assert float(jnp.max(jnp.abs(got - exact))) < 0.05 * float(jnp.max(jnp.abs(exact)))
  # Decoded through the slots, most outputs are the float32 model's (the 20-step smoke model's
  # outputs repeat pieces of near-equal scores, whose order int8's rounding may swap).
  options = DecodeOptions(beam_size=1)
  full = translator.decode_slots(rows, options, num_slots=4)
  low = Translator(trained[1], int8_weights=True).decode_slots(rows, options, num_slots=4)
  same = sum(np.array_equal(a[0], b[0]) for a, b in zip(full, low))
  assert same >= 0.5 * len(rows)


def test_a_models_parameter_tree_is_what_it_was_before_int8(translator):
  """The feed-forward's own Dense keeps nn.Dense's names: checkpoints restore as before."""
  names = set(translator.params["encoder_0"]["ffn"].keys()) | set(
      translator.params["decoder_0"]["ffn"].keys())
  assert names == {"wi", "wo"}
  assert set(translator.params["decoder_0"]["ffn"]["wi"]) == {"kernel", "bias"}


def test_a_shortlist_keeps_the_pieces_that_come_with_a_source_piece_besides_the_frequent():
  sources = [[5, 6], [5, 7], [5, 6], [8]]
  targets = [[10, 11], [10, 12], [10, 11, 13], [10, 13]]
  table = shortlist.build(sources, targets, vocab=16, per_piece=2, frequent=1)
  assert table[-1].tolist() == [10]  # In every target.
  assert table[5].tolist() == [11, 12]  # 11 twice, 13 and 12 once: ties by id.
  assert table[6].tolist() == [11, 13]
  assert table[7].tolist() == [12]
  assert table[8].tolist() == [13]
  assert set(table) == {-1, 5, 6, 7, 8}
  with pytest.raises(InferenceError, match="needs pairs"):
    shortlist.build([], [], vocab=16)


def test_a_shortlist_file_reads_back_what_was_written_and_a_bad_one_is_refused(tmp_path):
  pieces = ["<pad>", "<unk>", "</s>", "<s>", "▁a", "▁b", "c"]
  table = {-1: np.array([2, 4]), 5: np.array([6, 4]), 6: np.array([], np.int64)}
  shortlist.write(table, pieces, tmp_path / "map.tsv")
  assert (tmp_path / "map.tsv").read_text(encoding="utf-8") == "\t</s> ▁a\n▁b\tc ▁a\nc\t\n"
  back = shortlist.read(tmp_path / "map.tsv", pieces)
  assert {k: v.tolist() for k, v in back.items()} == {-1: [2, 4], 5: [6, 4], 6: []}
  (tmp_path / "bad.tsv").write_text("\t▁a\n▁b\t▁zz\n", encoding="utf-8")
  with pytest.raises(InferenceError, match=r"bad.tsv:2: '▁zz' is no piece"):
    shortlist.read(tmp_path / "bad.tsv", pieces)
  (tmp_path / "none.tsv").write_text("▁b\t▁a\n", encoding="utf-8")
  with pytest.raises(InferenceError, match="no line of always-kept pieces"):
    shortlist.read(tmp_path / "none.tsv", pieces)


def test_a_steps_columns_are_the_union_of_its_sources_candidates_in_id_order():
  table = {-1: np.array([7]), 3: np.array([9, 5]), 4: np.array([1])}
  candidates = shortlist.Candidates(table, vocab=12, always=(2,), width=6)
  masks = candidates.of_sources(jnp.asarray([[3, 0], [4, 4]]))
  assert np.flatnonzero(masks[0]).tolist() == [2, 5, 7, 9]  # With the always-kept 2 and 7.
  assert np.flatnonzero(masks[1]).tolist() == [1, 2, 7]
  ids, allowed = candidates.columns(masks)
  assert ids.tolist()[:5] == [1, 2, 5, 7, 9]  # The union, in id order, then padding.
  assert allowed.tolist() == [[False, True, True, True, True, False],
                              [True, True, False, True, False, False]]


def _file(translator, tmp_path, keep: set[int]) -> str:
  """A shortlist whose every source keeps `keep` (and nothing else)."""
  pieces = translator.tokenizers.tgt.pieces()
  path = tmp_path / "shortlist.tsv"
  shortlist.write({-1: np.array(sorted(keep))}, pieces, path)
  return str(path)


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_shortlist_holding_the_full_vocabularys_outputs_gives_them(translator, trained,
                                                                     rows, tmp_path, beam_size):
  """Greedy: the same outputs whenever each step's choice is in the list. Beam: the whole
  vocabulary as the list gives the same beams and scores; the list less the lowest piece no
  output uses (every column after it then stands for another id than its index, so a mapping
  back off by one fails) gives the same best beam for 9 sources in 10 (the 20-step smoke
  model's distributions are nearly flat: one piece's share moves a beam's score by about 0.05,
  and its best two beams lie 0.001 to 0.07 apart)."""
  options = DecodeOptions(beam_size=beam_size, alpha=0.6)
  full = translator.decode_slots(rows, options, num_slots=4)
  used = {int(t) for tokens, _ in full for t in tokens.ravel()} | {EOS}
  vocab = translator.tokenizers.tgt.vocab_size
  lowest_unused = min(set(range(4, vocab)) - used)
  if beam_size == 1:
    lists = [(used, len(rows))]
  else:
    everything = set(range(vocab))
    whole = Translator(trained[1], shortlist=_file(translator, tmp_path, everything))
    for (a, sa), (b, sb) in zip(full, whole.decode_slots(rows, options, num_slots=4)):
      np.testing.assert_array_equal(b, a)
      np.testing.assert_allclose(sb, sa, rtol=1e-6)
    lists = [(everything - {lowest_unused}, int(0.9 * len(rows)))]
  for keep, least in lists:
    short = Translator(trained[1], shortlist=_file(translator, tmp_path, keep))
    got = short.decode_slots(rows, options, num_slots=4)
    assert sum(np.array_equal(b[0][0], a[0][0]) for a, b in zip(full, got)) >= least
  # A list without the outputs' most used piece: no output holds it.
  top = max(used - {EOS, 0}, key=lambda t: sum(int((tokens == t).sum()) for tokens, _ in full))
  short = Translator(trained[1], shortlist=_file(translator, tmp_path, used - {top}))
  assert all(top not in tokens for tokens, _ in short.decode_slots(rows, options, num_slots=4))


def _translate(*args, cwd=ROOT):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "translate", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=600)


def test_translate_with_int8_and_a_shortlist_builds_the_map_and_exports_carry_it(trained,
                                                                                 tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained[1], workdir)
  result = _translate("--workdir", str(workdir), "--int8", "--shortlist", "--beam_size", "2",
                      "I lost.", "He is at home.")
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(result.stdout.strip().splitlines()) == 2
  assert "building the vocabulary shortlist" in result.stderr
  table = shortlist.read(workdir / shortlist.FILE, Translator(workdir).tokenizers.tgt.pieces())
  assert len(table[-1]) == shortlist.FREQUENT and len(table) > 100
  result = _translate("--workdir", str(workdir), "--shortlist", "--slots", "0", "I lost.")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].endswith(
      "--shortlist needs decoding slots: --slots 0 decodes in batches")
  pytest.importorskip("ctranslate2")
  out = tmp_path / "ct2"
  result = subprocess.run([sys.executable, "-m", "transformer_jax", "export", "--workdir",
                           str(workdir), "--to", "ctranslate2", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert (out / "vmap.txt").read_bytes() == (workdir / shortlist.FILE).read_bytes()
