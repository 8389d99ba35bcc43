import numpy as np
import pytest

from tests.conftest import DATA
from transformer_jax.data import builders, pipeline, sources
from transformer_jax.data.tokenizer import BOS, EOS, Tokenizers, WordVocab, train_tokenizers


def test_fra_eng_splits_are_disjoint_by_english_sentence(fra_eng_builder):
  splits = {s: sources.pairs(fra_eng_builder, "fra_eng", s)
            for s in ("train", "validation", "test")}
  assert sum(len(p) for p in splits.values()) == 167_130  # Every line of fra.txt.
  english = {s: {en for en, _ in p} for s, p in splits.items()}
  assert not english["train"] & english["validation"]
  assert not english["train"] & english["test"]
  assert not english["validation"] & english["test"]
  assert 2_500 < len(splits["validation"]) < 4_500
  assert splits["train"][:3] == [("Go.", "Va !"), ("Hi.", "Salut !"), ("Run!", "Cours !")]
  assert not any("\u202f" in fr or "\xa0" in fr for _, fr in splits["train"])


def test_multi30k_builder_reads_local_files(tfds_dir):
  builder = sources.prepare("multi30k_en_de", tfds_dir, str(DATA / "multi30k"))
  assert builder.info.splits["train"].num_examples == 29_000
  assert builder.info.splits["validation"].num_examples == 1_014
  en, de = sources.pairs(builder, "multi30k_en_de", "test[:1]")[0]
  assert en and de and en != de


def test_missing_local_files_name_the_directory(tmp_path):
  (tmp_path / "raw").mkdir()
  (tmp_path / "raw" / "unrelated.txt").write_text("x")
  with pytest.raises(FileNotFoundError, match="neither fra-eng.zip nor fra.txt"):
    sources.prepare("fra_eng", str(tmp_path / "tfds"), str(tmp_path / "raw"))


def test_normalize_replaces_narrow_and_non_breaking_spaces():
  assert builders.normalize("Va\u202f!\xa0Oui") == "Va ! Oui"


def test_word_vocab_follows_d2l():
  vocab = WordVocab.train(["I lost.", "I lost!", "Go."], min_freq=2)
  assert vocab.tokens[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
  assert set(vocab.tokens[4:]) == {"i", "lost", "."}  # "!" is seen once only.
  ids = vocab.encode(["I lost!"])[0]
  assert vocab.decode(ids) == "i lost <unk>"


def test_tokenizers_round_trip_through_the_workdir(tmp_path):
  pairs = [("I am here.", "Je suis là."), ("You are there.", "Tu es là-bas.")] * 50
  spm = train_tokenizers(pairs, "sentencepiece", 40)
  spm.save(tmp_path)
  loaded = Tokenizers.load(tmp_path)
  assert loaded.src.encode(["I am here."]) == spm.src.encode(["I am here."])
  assert loaded.tgt.decode(loaded.tgt.encode(["Je suis là."])[0]) == "Je suis là."
  (tmp_path / "tokenizer.model").write_bytes(b"not a model")
  with pytest.raises(ValueError, match="corrupt tokenizer"):
    Tokenizers.load(tmp_path)


def _examples(n=200, seed=0):
  rng = np.random.default_rng(seed)
  pairs = [(" ".join(["a"] * rng.integers(1, 12)), " ".join(["b"] * rng.integers(1, 12)))
           for _ in range(n)]
  tok = Tokenizers(WordVocab.train(["a"] * 2), WordVocab.train(["b"] * 2))
  return pipeline.tokenize(pairs, tok, max_len=8)


def test_overlong_pairs_are_counted():
  examples, stats = _examples()
  assert stats.total == 200 and stats.kept == len(examples)
  assert stats.dropped == 200 - stats.kept > 0
  ex = examples[0]
  assert ex["inputs"][-1] == EOS and ex["targets"][-1] == EOS
  assert ex["decoder_inputs"][0] == BOS
  np.testing.assert_array_equal(ex["decoder_inputs"][1:], ex["targets"][:-1])


@pytest.mark.parametrize("packing", [True, False])
def test_train_batches_have_one_shape_and_resume_from_state(packing):
  examples, _ = _examples()
  ds = pipeline.train_dataset(examples, batch_size=4, max_len=8, seed=3, packing=packing)
  it = iter(ds)
  for _ in range(3):
    batch = next(it)
  assert {k: v.shape for k, v in batch.items()} == {k: (4, 8) for k in batch}
  assert set(batch) == {"inputs", "decoder_inputs", "targets", "inputs_segment_ids",
                        "inputs_positions", "targets_segment_ids", "targets_positions"}
  state = it.get_state()
  expected = [next(it) for _ in range(5)]
  it2 = iter(ds)
  it2.set_state(state)
  for want in expected:
    got = next(it2)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  # Packed rows hold several sentences, positions restart in each.
  if packing:
    seg, pos = expected[0]["targets_segment_ids"], expected[0]["targets_positions"]
    assert seg.max() > 1
    starts = (seg > 0) & (np.diff(seg, prepend=0, axis=1) != 0)
    assert (pos[starts] == 0).all()


def test_hosts_read_disjoint_shards():
  examples, _ = _examples()
  rows = []
  for host in range(2):
    ds = pipeline.train_dataset(examples, batch_size=4, max_len=8, seed=0, packing=False,
                                process_index=host, process_count=2)
    batch = next(iter(ds))
    assert batch["inputs"].shape == (2, 8)
    rows.append({tuple(r) for r in batch["inputs"]})
  # Examples are random-length runs of one token, so equal rows mean equal lengths only;
  # instead check the shards directly.
  shard0 = {id(e) for e in examples[0::2]}
  assert not shard0 & {id(e) for e in examples[1::2]}


def test_eval_batches_cover_every_example_once():
  examples, _ = _examples()
  batches = pipeline.eval_batches(examples, batch_size=16, max_len=8)
  assert all(b["inputs"].shape == (16, 8) for b in batches)
  real_rows = sum(int((b["targets_segment_ids"].sum(1) > 0).sum()) for b in batches)
  assert real_rows == len(examples)
  tokens = sum(int(b["targets_segment_ids"].sum()) for b in batches)
  assert tokens == sum(len(e["targets"]) for e in examples)
