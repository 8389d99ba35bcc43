import functools
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import DATA, ROOT
from transformer_jax.data import builders, packing, pipeline, sources, token_cache
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
  with pytest.raises(ValueError, match="is damaged or empty"):
    Tokenizers.load(tmp_path)


class ListPairs:
  """In-memory stand-in for sources.TextPairs (same read interface), for small exact cases."""

  def __init__(self, pairs, split="train"):
    self.pairs, self.split = pairs, split

  def __len__(self):
    return len(self.pairs)

  def read(self, indices):
    chosen = [self.pairs[i] for i in indices]
    return [p[0] for p in chosen], [p[1] for p in chosen]


def _random_pairs(n=200, seed=0, longest=12):
  rng = np.random.default_rng(seed)
  return [(" ".join(["a"] * rng.integers(1, longest)), " ".join(["b"] * rng.integers(1, longest)))
          for _ in range(n)]


def _cache(tmp_path, pairs, workers=0, name="c"):
  """A real token cache of `pairs` under a word tokenizer (one token per word)."""
  tok = Tokenizers(WordVocab.train(["a a b b"]), WordVocab.train(["a a b b"]))
  return token_cache.build(tmp_path / name, ListPairs(pairs), tok, "fp", num_workers=workers,
                           chunk_size=16)


def _stream(cache, **kw):
  args = dict(batch_size=4, max_len=8, overlong="drop", seed=3)
  args.update(kw)
  return pipeline.pair_stream(cache, **args)



def test_token_cache_holds_every_pair_and_refuses_another_tokenizer(tmp_path):
  pairs = _random_pairs(50) + [("", "b")]
  cache = _cache(tmp_path, pairs)
  assert cache.num_pairs == 51
  for i, (src, tgt) in enumerate(pairs):
    assert len(cache.ids("src", i)) == len(src.split())
    assert list(cache.ids("tgt", i)) == [5] * len(tgt.split())  # <pad> <bos> <eos> <unk> a b
  again = _cache(tmp_path, [("x", "y")])  # Finished caches are reused, not rebuilt.
  assert again.num_pairs == 51
  tok = Tokenizers(WordVocab.train(["a a"]), WordVocab.train(["b b"]))
  with pytest.raises(ValueError, match="another tokenizer"):
    token_cache.build(tmp_path / "c", ListPairs(pairs), tok, "other", num_workers=0)
  assert not list(tmp_path.glob("*.tmp-*"))  # No half-written cache left behind.


def test_cache_built_by_two_workers_equals_the_in_process_one(tmp_path):
  pairs = _random_pairs(600, seed=1)  # 38 chunks of 16: enough to start workers.
  one, two = _cache(tmp_path, pairs, 0, "one"), _cache(tmp_path, pairs, 2, "two")
  for side in token_cache.SIDES:
    np.testing.assert_array_equal(one.tokens(side), two.tokens(side))
    np.testing.assert_array_equal(one.offsets(side), two.offsets(side))


def test_overlong_and_empty_pairs_are_counted(tmp_path):
  cache = _cache(tmp_path, _random_pairs() + [("", "b")])
  drop = packing.select(cache, max_len=8, overlong="drop")
  lengths = np.maximum(cache.lengths("src"), cache.lengths("tgt"))
  assert drop.total == 201 and drop.dropped == int((lengths + 1 > 8).sum()) + 1 > 1
  assert len(drop.ids) == 201 - drop.dropped and drop.truncated == 0
  cut = packing.select(cache, max_len=8, overlong="truncate")
  assert cut.dropped == 1 and cut.truncated == drop.dropped - 1
  assert cut.src_len.max() == cut.tgt_len.max() == 7


def test_first_fit_places_every_pair_once_within_the_rows():
  rng = np.random.default_rng(0)
  src, tgt = rng.integers(1, 30, 500), rng.integers(1, 30, 500)
  plans = packing.first_fit(src, tgt, rows=6, max_len=32)
  placed = np.concatenate([p.example for p in plans])
  assert sorted(placed.tolist()) == list(range(500))
  for p in plans:
    for row in range(6):
      mine = p.row == row
      # Pairs in a row follow each other without overlap, within max_len, on both sides.
      for offsets, lens in ((p.src_offset, src), (p.tgt_offset, tgt)):
        ends = offsets[mine] + lens[p.example[mine]]
        assert ends.max(initial=0) <= 32
        np.testing.assert_array_equal(offsets[mine][1:], ends[:-1])
  fill = tgt.sum() / (len(plans) * 6 * 32)
  assert fill > 0.8  # Pairs of up to 30 tokens in rows of 32 leave some room.
  with pytest.raises(ValueError, match="lengths must lie"):
    packing.first_fit(np.array([33]), np.array([3]), rows=2, max_len=32)


@pytest.mark.parametrize("packed", [True, False])
def test_batches_have_one_shape_and_rebuild_the_pairs(tmp_path, packed):
  pairs = _random_pairs()
  cache = _cache(tmp_path, pairs)
  stream = _stream(cache, pack=packed)
  seen, shared_rows = [], 0
  for _ in range(60):  # Over an epoch of the ~150 kept pairs.
    batch = next(stream)
    assert {k: v.shape for k, v in batch.items()} == {k: (4, 8) for k in packing.FEATURES}
    shared_rows += int((batch["targets_segment_ids"].max(1) > 1).sum())
    for r in range(4):
      seg = batch["targets_segment_ids"][r]
      for s in range(1, seg.max() + 1):
        src = batch["inputs"][r][batch["inputs_segment_ids"][r] == s]
        tgt = batch["targets"][r][seg == s]
        dec = batch["decoder_inputs"][r][seg == s]
        assert src[-1] == tgt[-1] == EOS and dec[0] == BOS
        np.testing.assert_array_equal(dec[1:], tgt[:-1])
        np.testing.assert_array_equal(batch["targets_positions"][r][seg == s],
                                      np.arange(len(tgt)))
        seen.append((len(src) - 1, len(tgt) - 1))
  stream.close()
  kept = [(len(a.split()), len(b.split())) for a, b in pairs
          if max(len(a.split()), len(b.split())) + 1 <= 8]
  first_epoch = seen[:len(kept)]
  assert sorted(first_epoch) == sorted(kept)  # Each kept pair once per epoch.
  assert (shared_rows > 0) == packed  # Packed rows hold several pairs; padded rows one.


def test_concatenation_joins_consecutive_pairs_whole_and_aligned(tmp_path):
  rng = np.random.default_rng(5)
  pairs = [(" ".join(f"s{i}x{k}" for k in range(rng.integers(1, 6))),
            " ".join(f"t{i}x{k}" for k in range(rng.integers(1, 6)))) for i in range(300)]
  words = " ".join(" ".join(p) for p in pairs)
  tok = Tokenizers(WordVocab.train([words, words]), WordVocab.train([words, words]))
  cache = token_cache.build(tmp_path / "c", ListPairs(pairs), tok, "fp", num_workers=0,
                            chunk_size=16)
  stream = _stream(cache, batch_size=4, max_len=16, concat_prob=0.5, concat_max=3)
  kept = {i for i, (a, b) in enumerate(pairs) if max(len(a.split()), len(b.split())) < 16}
  seen, sizes = [], []
  while len(seen) < len(kept):  # One epoch.
    batch = next(stream)
    for r in range(4):
      for s in range(1, batch["targets_segment_ids"][r].max() + 1):
        src = batch["inputs"][r][batch["inputs_segment_ids"][r] == s]
        tgt = batch["targets"][r][batch["targets_segment_ids"][r] == s]
        dec = batch["decoder_inputs"][r][batch["targets_segment_ids"][r] == s]
        assert src[-1] == tgt[-1] == EOS and EOS not in src[:-1] and EOS not in tgt[:-1]
        assert dec[0] == BOS
        np.testing.assert_array_equal(dec[1:], tgt[:-1])
        np.testing.assert_array_equal(batch["inputs_positions"][r][
            batch["inputs_segment_ids"][r] == s], np.arange(len(src)))
        # The source words are whole pairs' sources, in order; the target the same pairs'.
        src_words, tgt_words = tok.src.decode(src).split(), tok.tgt.decode(tgt).split()
        ids = list(dict.fromkeys(int(w[1:].split("x")[0]) for w in src_words))
        assert src_words == " ".join(pairs[i][0] for i in ids).split()
        assert tgt_words == " ".join(pairs[i][1] for i in ids).split()
        seen += ids
        sizes.append(len(ids))
  stream.close()
  assert sorted(seen[:len(kept)]) == sorted(kept)  # Each kept pair once per epoch.
  assert max(sizes) == 3 and sizes.count(1) > 0 and sizes.count(2) > 0
  plain = _stream(cache, batch_size=4, max_len=16)
  batch = next(plain)
  plain.close()
  assert sum(batch["targets_segment_ids"].max(1)) == len(
      {int(w[1:].split("x")[0]) for w in tok.src.decode(batch["inputs"].ravel()).split()})


@pytest.mark.parametrize("concat_prob", [0.0, 0.5])
def test_stream_resumes_from_its_state_with_any_worker_count(tmp_path, concat_prob):
  cache = _cache(tmp_path, _random_pairs(400, seed=2))
  make = functools.partial(_stream, concat_prob=concat_prob, concat_max=3)
  stream = make(cache)
  for _ in range(37):
    next(stream)
  state = stream.get_state()
  expected = [next(stream) for _ in range(70)]  # Crosses blocks and an epoch.
  stream.close()
  for workers in (0, 2):
    resumed = make(cache, num_workers=workers)
    resumed.set_state(state)
    for want in expected:
      got = next(resumed)
      for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    resumed.close()


def test_hosts_together_see_the_single_host_batches(tmp_path):
  cache = _cache(tmp_path, _random_pairs(300, seed=4))
  single = _stream(cache)
  hosts = [_stream(cache, process_index=i, process_count=2) for i in range(2)]
  for _ in range(40):
    whole = next(single)
    parts = [next(h) for h in hosts]
    assert parts[0]["inputs"].shape == (2, 8)
    for k in whole:
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
  assert hosts[0].get_state() == hosts[1].get_state() == single.get_state()
  with pytest.raises(ValueError, match="not divisible"):
    _stream(cache, process_count=3)


@pytest.mark.parametrize("pack", [True, False])
def test_eval_batches_cover_every_kept_pair_once(tmp_path, pack):
  cache = _cache(tmp_path, _random_pairs())
  sel = packing.select(cache, 8, "drop")
  per_host = {}
  for hosts in (1, 2):
    batches = [pipeline.eval_batches(cache, batch_size=16, max_len=8, overlong="drop", pack=pack,
                                     process_index=i, process_count=hosts) for i in range(hosts)]
    assert len({len(b) for b in batches}) == 1  # Every host: the same number of batches.
    rows = [b for host in batches for b in host]
    assert all(b["inputs"].shape == (16 // hosts, 8) for b in rows)
    # Each (row, segment) is one pair; read back in order, they are the selection's pairs.
    got = []
    for b in zip(*batches):
      b = {k: np.concatenate([part[k] for part in b]) for k in b[0]}
      for r in range(16):
        for seg in range(1, b["targets_segment_ids"][r].max() + 1):
          got.append((b["inputs"][r][b["inputs_segment_ids"][r] == seg][:-1].tolist(),
                      b["targets"][r][b["targets_segment_ids"][r] == seg][:-1].tolist()))
    assert sorted(got) == sorted((list(cache.ids("src", i)), list(cache.ids("tgt", i)))
                                 for i in sel.ids)
    per_host[hosts] = [np.concatenate([part[k] for part in b]) for b in zip(*batches)
                       for k in sorted(b[0])]
  # Two hosts' rows, put together, are the one host's batches.
  for a, b in zip(per_host[1], per_host[2], strict=True):
    np.testing.assert_array_equal(a, b)
  rows_used = sum(int((b["targets_segment_ids"].max(1) > 0).sum()) for b in
                  pipeline.eval_batches(cache, batch_size=16, max_len=8, overlong="drop",
                                        pack=pack))
  assert (rows_used < len(sel.ids)) if pack else (rows_used == len(sel.ids))


def test_prepare_fits_the_tokenizer_once_and_shares_it(fra_eng_builder, tfds_dir, tmp_path):
  cfg = pipeline.DataConfig(
      dataset="fra_eng", data_dir=str(DATA / "fra-eng"), tfds_dir=tfds_dir,
      cache_dir=str(tmp_path / "cache"), train_split="train[:3000]", eval_split="validation[:100]",
      tokenizer="sentencepiece", vocab_size=300, tokenizer_sample=1000, max_len=32,
      overlong="drop", num_workers=0, batch_size=16)
  first = pipeline.prepare(cfg, tmp_path / "w1", num_bleu_sentences=10)
  assert first.train.num_pairs == 3000 and first.eval.num_pairs == 100
  assert len(first.bleu_pairs) == 10 and first.bleu_pairs[0] == sources.pairs(
      fra_eng_builder, "fra_eng", "validation[:1]")[0]
  # The cached ids are what the tokenizer gives for the split's sentences.
  src, tgt = sources.pairs(fra_eng_builder, "fra_eng", "train[:3000]")[1234]
  assert list(first.train.ids("src", 1234)) == first.tokenizers.src.encode([src])[0]
  assert list(first.train.ids("tgt", 1234)) == first.tokenizers.tgt.encode([tgt])[0]
  second = pipeline.prepare(cfg, tmp_path / "w2")  # A new workdir reuses tokenizer and cache.
  assert (tmp_path / "w2" / "tokenizer.model").read_bytes() == \
      (tmp_path / "w1" / "tokenizer.model").read_bytes()
  assert second.train.directory == first.train.directory


def test_preparing_a_dataset_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
  """tfds made (and left) an empty tmpXXXXtfds directory there for every new builder."""
  import tempfile
  raw, temporary = tmp_path / "raw", tmp_path / "temporary"
  raw.mkdir()
  temporary.mkdir()
  for split in ("train", "validation"):
    (raw / f"{split}.tsv").write_text("a b\tc d\ne f\tg h\n")
  monkeypatch.setattr(tempfile, "tempdir", str(temporary))
  builder = sources.prepare("parallel_tsv", str(tmp_path / "tfds"), str(raw))
  assert builder.info.splits["train"].num_examples == 2
  assert list(temporary.iterdir()) == []


def test_a_vocabulary_larger_than_the_corpus_gives_is_said_in_a_warning(caplog):
  """SentencePiece stops where the corpus has no more pieces (hard_vocab_limit=False): the
  config's data.vocab_size is then not what the run has, and the log says what it has."""
  words = ["le chat", "la maison", "un chien noir", "the cat", "a black dog", "the house"]
  sentences = [" ".join(words[(i + j) % len(words)] for j in range(3)) for i in range(60)]
  tokenizers = train_tokenizers([(s, s) for s in sentences], "sentencepiece", 10 ** 9)
  pieces = tokenizers.src.vocab_size
  assert 4 < pieces < 200
  assert (f"data.vocab_size=1000000000, but this corpus gives {pieces} pieces: the tokenizer "
          f"and the model have {pieces}") in caplog.text


_FIT = """
import hashlib, sys
from transformer_jax.data.tokenizer import SentencePiece
lines = [f"line {i} of {'abcdefghij'[i % 10] * (1 + i % 7)} words {i * 7919 % 1000}" for i in range(6000)]
print(hashlib.sha256(SentencePiece.train(lines, 300, max_sentences=2000).model_proto).hexdigest())
"""


def test_a_tokenizer_fitted_on_a_sample_of_a_larger_input_is_the_same_in_every_process():
  """Two processes fit one corpus of more sentences than the sample: one tokenizer (with
  SentencePiece's own sampling they differed, and so did two runs of one language model)."""
  fits = {subprocess.run([sys.executable, "-c", _FIT], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=300).stdout.strip() for _ in range(2)}
  assert len(fits) == 1 and len(fits.pop()) == 64
