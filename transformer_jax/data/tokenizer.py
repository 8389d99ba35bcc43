"""Tokenizers: a joint SentencePiece model, d2l's word-level vocabularies, or a Hugging Face
checkpoint's own tokenizer (for a run that starts from the checkpoint).

All use the same special ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>. A pair of tokenizers
(source, target) is saved into the workdir so that decoding uses the ones training used.
"""

from __future__ import annotations

import collections
import io
import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, NamedTuple, Protocol

import numpy as np
import sentencepiece as spm
from absl import logging

from transformer_jax.errors import UserError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
RESERVED = ("<pad>", "<bos>", "<eos>", "<unk>")
SPM_FILE = "tokenizer.model"
WORD_FILE = "vocab.json"
HF_FILE = "tokenizer.huggingface.json"  # A checkpoint's tokenizer.json and its id table.
NEW = -1  # In HuggingFaceTokenizer.ids: a token the checkpoint has no row for.


class Tokenizer(Protocol):
  vocab_size: int

  def encode(self, texts: list[str]) -> list[list[int]]: ...

  def decode(self, ids: Iterable[int]) -> str: ...

  def pieces(self) -> list[str]: ...


# Fewer texts than this are encoded one by one: SentencePiece's batched encode starts a thread
# pool per call (about 0.1 ms on an idle 2-core CPU, far more on a busy one), which pays only
# for large batches.
THREADED_ENCODE = 64


def _same_sample(sentences: Iterable[str], k: int) -> list[str]:
  """At most `k` of `sentences` in their order, the same `k` on every run (a fixed seed):
  SentencePiece's own sampling of a larger input draws from a seed of its own, and two fits of
  one corpus gave two tokenizers."""
  sentences = list(sentences)
  if len(sentences) <= k:
    return sentences
  return [sentences[i] for i in np.sort(np.random.default_rng(0).choice(len(sentences), k,
                                                                        replace=False))]


class SentencePiece:
  """A joint SentencePiece unigram model."""

  def __init__(self, model_proto: bytes, num_threads: int = -1):
    """`num_threads`: threads of a batched `encode` (-1: one per CPU core)."""
    self.model_proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto, num_threads=num_threads)
    self.vocab_size = self._sp.get_piece_size()
    if self.vocab_size == 0:  # An empty proto loads without complaint but holds no model.
      raise ValueError("the SentencePiece model holds no pieces")

  def __reduce__(self):
    # Pickled for grain worker processes: one thread each, since the workers are the
    # parallelism (N workers x all cores would oversubscribe the CPU).
    return SentencePiece, (self.model_proto, 1)

  @classmethod
  def train(cls, sentences: Iterable[str], vocab_size: int, max_sentences: int = 400_000,
            lossless: bool = False):
    """`lossless`: decode(encode(text)) == text for any text: no normalization, every space
    and newline kept, a character never seen in training spelled as its UTF-8 bytes (a
    language model's documents)."""
    model = io.BytesIO()
    exact = dict(normalization_rule_name="identity", remove_extra_whitespaces=False,
                 add_dummy_prefix=False, user_defined_symbols=["\n"],
                 allow_whitespace_only_pieces=True, byte_fallback=True) if lossless else {}
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(_same_sample(sentences, max_sentences)), model_writer=model,
          vocab_size=vocab_size, model_type="unigram", character_coverage=1.0, pad_id=PAD,
          bos_id=BOS, eos_id=EOS, unk_id=UNK, input_sentence_size=max_sentences,
          num_threads=2, minloglevel=2, hard_vocab_limit=False,  # Small corpora: fewer pieces.
          **exact)
    except RuntimeError as e:
      needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
      if not needed:
        raise
      what = "each of its characters, the 256 bytes" if lossless else "each of its characters"
      raise TokenizerError(
          f"data.vocab_size={vocab_size} is below the {needed[1]} pieces this corpus needs "
          f"({what} and the reserved ids): raise it past {needed[1]} (SentencePiece's count; "
          "a larger vocabulary may need a few more)") from None
    trained = cls(model.getvalue())
    if trained.vocab_size < vocab_size:  # hard_vocab_limit=False: what the corpus holds.
      logging.warning("data.vocab_size=%d, but this corpus gives %d pieces: the tokenizer and "
                      "the model have %d", vocab_size, trained.vocab_size, trained.vocab_size)
    return trained

  def encode(self, texts):
    texts = list(texts)
    if len(texts) < THREADED_ENCODE:  # A batched call starts its threads every time.
      return [self._sp.encode(text) for text in texts]
    return self._sp.encode(texts)

  def decode(self, ids):
    return self._sp.decode([int(i) for i in ids if i >= UNK])  # Drop pad, bos, eos.

  def pieces(self) -> list[str]:
    """Every piece, by id (the reserved ids' names included)."""
    return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

  def scores(self) -> list[float]:
    """Every piece's unigram log-probability (its score in the model), by id."""
    return [self._sp.get_score(i) for i in range(self.vocab_size)]

  def characters(self) -> list[int]:
    """The characters of text each id stands for, by id: 0 for <pad>, <bos> and <eos>, 1 for
    <unk> (one unknown character); a byte piece counts 1 where it starts a UTF-8 character,
    0 where it continues one."""
    def count(i: int) -> int:
      if i < UNK:
        return 0
      if i == UNK:
        return 1
      if self._sp.is_byte(i):
        return 0 if 0x80 <= int(self._sp.id_to_piece(i)[1:-1], 16) < 0xC0 else 1
      return len(self._sp.decode([i]))
    return [count(i) for i in range(self.vocab_size)]


def word_marks(tokenizer: Tokenizer) -> list[int]:
  """Per id: bit 0 where the piece's text holds a letter or digit, bit 1 where it begins with
  whitespace (what whole-word masking reads; reserved ids and bytes of non-ASCII characters
  have neither)."""
  marks = []
  for i in range(tokenizer.vocab_size):
    text = tokenizer.decode([i]) if i > UNK else ""
    marks.append(any(c.isalnum() for c in text) | (text[:1].isspace() << 1))
  return marks


def d2l_preprocess(text: str) -> str:
  """d2l's word-level normalization: lowercase, a space before , . ! ? when missing."""
  text = text.replace("\u202f", " ").replace("\xa0", " ").lower()
  return re.sub(r"(?<=\S)([,.!?])", r" \1", text)


class WordVocab:
  """d2l's Vocab: tokens seen at least `min_freq` times, most frequent first."""

  def __init__(self, tokens: list[str]):
    self.tokens = tokens
    self._index = {t: i for i, t in enumerate(tokens)}
    self.vocab_size = len(tokens)

  @classmethod
  def train(cls, sentences: Iterable[str], min_freq: int = 2):
    counts = collections.Counter(
        tok for s in sentences for tok in d2l_preprocess(s).split())
    kept = sorted((t for t, c in counts.items() if c >= min_freq and t not in RESERVED),
                  key=lambda t: (-counts[t], t))
    return cls(list(RESERVED) + kept)

  def encode(self, texts):
    return [[self._index.get(t, UNK) for t in d2l_preprocess(s).split()] for s in texts]

  def decode(self, ids):
    return " ".join(self.tokens[i] for i in ids if i > EOS)

  def pieces(self) -> list[str]:
    return list(self.tokens)


# A Hugging Face checkpoint's own tokenizer (its tokenizer.json), in this project's ids.
#
# Every part of this project reads <pad> as id 0, <bos> 1, <eos> 2 and <unk> 3, and a masked
# language model's mask as the id after the pieces (models/build.py). A checkpoint puts its
# special tokens elsewhere (BERT: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103; GPT-2:
# <|endoftext|> 50256 and nothing else), so its ids are renumbered once, on import, and every
# table indexed by token id (the embeddings, BERT's output bias) is permuted the same way
# (interop/huggingface.py):
#
#   ids 0-3   the checkpoint's pad, start, end and unknown tokens (BERT's [CLS] starts a text and
#             [SEP] ends it; GPT-2's <|endoftext|> ends a document); a role the checkpoint has no
#             token of, or whose token holds another role already (GPT-2's one token is its
#             start, end, unknown and often its padding), is a new id of its own (`NEW`);
#   4 ...     the checkpoint's other tokens in their order;
#   last      its mask token, for a masked language model.
#
# `ids[i]` is the checkpoint's id behind our id i (NEW for a new one). The `tokenizers` library
# does the text work; nothing here needs transformers or torch.


class HuggingFaceTokenizer:
  """A checkpoint's tokenizer.json with its ids renumbered to this project's (module doc)."""

  def __init__(self, tokenizer_json: str, ids: list[int], mask: int | None = None):
    from tokenizers import Tokenizer
    self.tokenizer_json, self.ids, self.mask = tokenizer_json, list(ids), mask
    self._tok = Tokenizer.from_str(tokenizer_json)
    self.vocab_size = len(self.ids)
    size = max(max(self.ids), -1 if mask is None else mask) + 1
    self._ours = np.full(size, UNK, np.int64)  # The checkpoint's id -> ours.
    known = np.asarray(self.ids)
    self._ours[known[known >= 0]] = np.flatnonzero(known >= 0)
    if mask is not None:  # A text's literal mask token reads as the mask id.
      self._ours[mask] = self.vocab_size
    self._hf = known

  def __reduce__(self):  # Pickled for grain worker processes.
    return HuggingFaceTokenizer, (self.tokenizer_json, self.ids, self.mask)

  @classmethod
  def from_checkpoint(cls, path: Path, config: dict, masked: bool) -> "HuggingFaceTokenizer":
    """The tokenizer of the checkpoint directory `path` (its tokenizer.json, the special tokens
    named in tokenizer_config.json / special_tokens_map.json, else the ids in its `config`);
    `masked`: a masked language model, whose mask token takes the last id."""
    file = path / "tokenizer.json"
    if not file.is_file():
      raise TokenizerError(
          f"{path} holds no tokenizer.json (a fast tokenizer's file): save the tokenizer there "
          "with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(DIR)")
    from tokenizers import Tokenizer
    text = file.read_text()
    try:
      tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own exception types.
      raise TokenizerError(f"{file} is not a tokenizers file ({e})") from None
    names = _special_names(path)
    def token_id(key: str, config_key: str | None = None) -> int | None:
      found = tok.token_to_id(names[key]) if key in names else None
      return config.get(config_key) if found is None and config_key else found
    first = lambda *found: next((i for i in found if i is not None), None)
    role_ids = {"pad": token_id("pad_token", "pad_token_id"),
                "bos": first(token_id("cls_token"), token_id("bos_token", "bos_token_id")),
                "eos": first(token_id("sep_token"), token_id("eos_token", "eos_token_id")),
                "unk": token_id("unk_token")}
    if role_ids["eos"] is None:
      raise TokenizerError(
          f"{path}: its tokenizer names no end token (sep_token or eos_token in "
          "tokenizer_config.json, eos_token_id in config.json); a text's end needs one")
    mask = token_id("mask_token") if masked else None
    if masked and mask is None:
      raise TokenizerError(
          f"{path}: its tokenizer names no mask_token; a masked language model reads one")
    # A token in several roles takes the first of <eos>, <bos>, <unk>, <pad> (GPT-2's one
    # token ends documents here, and often pads too); the other roles get new ids.
    ids, taken = [NEW] * 4, {mask}
    for slot, role in ((EOS, "eos"), (BOS, "bos"), (UNK, "unk"), (PAD, "pad")):
      if role_ids[role] is not None and role_ids[role] not in taken:
        ids[slot] = role_ids[role]
        taken.add(role_ids[role])
    count = tok.get_vocab_size(with_added_tokens=True)
    ids += [i for i in range(count) if i not in taken]
    return cls(text, ids, mask)

  @property
  def new_rows(self) -> dict[int, int | None]:
    """Our ids with no row of their own in the checkpoint -> the checkpoint id whose row they
    start from: a new <bos> the end token's (GPT-2's document separator, which also starts
    one), the others None (the mean row)."""
    return {i: (self.ids[EOS] if i == BOS else None) for i, hf in enumerate(self.ids)
            if hf == NEW}

  def encode(self, texts):
    out = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [self._ours[np.asarray(e.ids, np.int64)].tolist() for e in out]

  def decode(self, ids):
    hf = [int(self._hf[i]) for i in ids if UNK <= i < self.vocab_size and self._hf[i] >= 0]
    return self._tok.decode(hf, skip_special_tokens=True)

  def pieces(self) -> list[str]:
    return [RESERVED[i] if hf == NEW else self._tok.id_to_token(hf)
            for i, hf in enumerate(self.ids)]

  def characters(self) -> list[int]:
    """The characters of text each id stands for (SentencePiece.characters): a
    byte-level token counts the bytes that start a UTF-8 character; another, its text."""
    decoder = json.loads(self.tokenizer_json).get("decoder") or {}
    to_byte = _byte_level_alphabet() if decoder.get("type") == "ByteLevel" else None
    def count(i: int, hf: int) -> int:
      if i < UNK or hf == NEW:
        return 0
      if i == UNK:
        return 1
      token = self._tok.id_to_token(hf)
      if to_byte is None or any(ch not in to_byte for ch in token):
        return len(self._tok.decode([hf]))
      return sum(1 for ch in token if not 0x80 <= to_byte[ch] < 0xC0)
    return [count(i, hf) for i, hf in enumerate(self.ids)]

  def serialized(self) -> bytes:
    return json.dumps({"tokenizer": json.loads(self.tokenizer_json), "ids": self.ids,
                       "mask": self.mask}).encode()

  @classmethod
  def deserialized(cls, payload: bytes) -> "HuggingFaceTokenizer":
    saved = json.loads(payload)
    return cls(json.dumps(saved["tokenizer"]), saved["ids"], saved["mask"])


def _special_names(path: Path) -> dict[str, str]:
  """Special-token names (pad_token, cls_token, ...) from the checkpoint's tokenizer files;
  tokenizer_config.json's win. A name may be written as {"content": NAME}."""
  names = {}
  for file in ("special_tokens_map.json", "tokenizer_config.json"):
    if (path / file).is_file():
      try:
        saved = json.loads((path / file).read_text())
      except ValueError as e:
        raise TokenizerError(f"{path / file} is not JSON ({e})") from None
      for key, value in saved.items():
        if key.endswith("_token") and value:
          names[key] = value["content"] if isinstance(value, dict) else value
  return names


def _byte_level_alphabet() -> dict[str, int]:
  """Byte-level BPE's character for each byte -> the byte: printable Latin-1 bytes stand for
  themselves, the other 68 for the characters from U+0100 on, in byte order (GPT-2's scheme)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
               *range(ord("\xae"), ord("\xff") + 1)]
  rest = [b for b in range(256) if b not in printable]
  chars = {chr(b): b for b in printable}
  chars.update({chr(256 + n): b for n, b in enumerate(rest)})
  return chars


class Tokenizers(NamedTuple):
  src: Tokenizer
  tgt: Tokenizer

  def same_as(self, other: "Tokenizers") -> bool:
    """Whether both map every piece to the same id, on both sides."""
    return all(type(a) is type(b) and a.pieces() == b.pieces()
               for a, b in ((self.src, other.src), (self.tgt, other.tgt)))

  def _serialized(self) -> tuple[str, bytes]:
    """(file name, bytes) as a workdir holds them."""
    if isinstance(self.src, HuggingFaceTokenizer):
      return HF_FILE, self.src.serialized()
    if isinstance(self.src, SentencePiece):
      return SPM_FILE, self.src.model_proto
    return WORD_FILE, json.dumps({"src": self.src.tokens, "tgt": self.tgt.tokens}).encode()

  def save(self, workdir: str | Path) -> None:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    name, payload = self._serialized()
    _atomic_write(workdir / name, payload)

  def digest(self) -> str:
    """The tokenizers' identity: sha256 of what `save` writes. Two vocabularies of one size
    (which pad to the same embedding shape) differ here."""
    return hashlib.sha256(self._serialized()[1]).hexdigest()

  @staticmethod
  def load(workdir: str | Path) -> "Tokenizers | None":
    """The tokenizers saved in `workdir`, or None if it holds none."""
    workdir = Path(workdir)
    try:
      if (workdir / HF_FILE).exists():
        tok = HuggingFaceTokenizer.deserialized((workdir / HF_FILE).read_bytes())
        return Tokenizers(tok, tok)
      if (workdir / SPM_FILE).exists():
        sp = SentencePiece((workdir / SPM_FILE).read_bytes())
        return Tokenizers(sp, sp)
      if (workdir / WORD_FILE).exists():
        vocab = json.loads((workdir / WORD_FILE).read_text())
        return Tokenizers(WordVocab(vocab["src"]), WordVocab(vocab["tgt"]))
    except Exception as e:  # sentencepiece, json and tokenizers each raise their own.
      name = next(n for n in (HF_FILE, SPM_FILE, WORD_FILE) if (workdir / n).exists())
      remedy = ("put back the copy a new run from the checkpoint (run.init_from) writes"
                if name == HF_FILE else "delete it to fit a new tokenizer")
      raise TokenizerError(f"{workdir / name} is damaged or empty ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                           f"{remedy}") from None
    return None


class TokenizerError(UserError, ValueError):
  """A saved tokenizer file (or a Hugging Face checkpoint's) that cannot be loaded."""


def train_tokenizers(pairs: list[tuple[str, str]], kind: str, vocab_size: int) -> Tokenizers:
  """Fits tokenizers on training pairs: one joint SentencePiece, or two d2l word vocabularies."""
  if kind == "sentencepiece":
    sp = SentencePiece.train((s for pair in pairs for s in pair), vocab_size)
    return Tokenizers(sp, sp)
  if kind == "word":
    return Tokenizers(WordVocab.train(p[0] for p in pairs), WordVocab.train(p[1] for p in pairs))
  raise ValueError(f"data.tokenizer must be 'sentencepiece' or 'word' to fit, got {kind!r}")


def _atomic_write(path: Path, data: bytes) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_bytes(data)
  tmp.replace(path)
