"""Tokenizers: a joint SentencePiece model, or d2l's word-level vocabularies.

Both use the same special ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>. A pair of tokenizers
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

import sentencepiece as spm

from transformer_jax.errors import UserError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
RESERVED = ("<pad>", "<bos>", "<eos>", "<unk>")
SPM_FILE = "tokenizer.model"
WORD_FILE = "vocab.json"


class Tokenizer(Protocol):
  vocab_size: int

  def encode(self, texts: list[str]) -> list[list[int]]: ...

  def decode(self, ids: Iterable[int]) -> str: ...

  def pieces(self) -> list[str]: ...


# Fewer texts than this are encoded one by one: SentencePiece's batched encode starts a thread
# pool per call (about 0.1 ms on an idle 2-core CPU, far more on a busy one), which pays only
# for large batches.
THREADED_ENCODE = 64


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
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, pad_id=PAD, bos_id=BOS, eos_id=EOS,
        unk_id=UNK, input_sentence_size=max_sentences, shuffle_input_sentence=True,
        num_threads=2, minloglevel=2, hard_vocab_limit=False,  # Small corpora: fewer pieces.
        **exact)
    return cls(model.getvalue())

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


class Tokenizers(NamedTuple):
  src: Tokenizer
  tgt: Tokenizer

  def same_as(self, other: "Tokenizers") -> bool:
    """Whether both map every piece to the same id, on both sides."""
    return all(type(a) is type(b) and a.pieces() == b.pieces()
               for a, b in ((self.src, other.src), (self.tgt, other.tgt)))

  def _serialized(self) -> tuple[str, bytes]:
    """(file name, bytes) as a workdir holds them."""
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
      if (workdir / SPM_FILE).exists():
        sp = SentencePiece((workdir / SPM_FILE).read_bytes())
        return Tokenizers(sp, sp)
      if (workdir / WORD_FILE).exists():
        vocab = json.loads((workdir / WORD_FILE).read_text())
        return Tokenizers(WordVocab(vocab["src"]), WordVocab(vocab["tgt"]))
    except (RuntimeError, ValueError, KeyError, TypeError, OSError) as e:
      name = SPM_FILE if (workdir / SPM_FILE).exists() else WORD_FILE
      raise TokenizerError(f"{workdir / name} is damaged or empty ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                           "delete it to fit a new tokenizer") from None
    return None


class TokenizerError(UserError, ValueError):
  """A saved tokenizer file that cannot be loaded."""


def train_tokenizers(pairs: list[tuple[str, str]], kind: str, vocab_size: int) -> Tokenizers:
  """Fits tokenizers on training pairs: one joint SentencePiece, or two d2l word vocabularies."""
  if kind == "sentencepiece":
    sp = SentencePiece.train((s for pair in pairs for s in pair), vocab_size)
    return Tokenizers(sp, sp)
  if kind == "word":
    return Tokenizers(WordVocab.train(p[0] for p in pairs), WordVocab.train(p[1] for p in pairs))
  raise ValueError(f"data.tokenizer must be 'sentencepiece' or 'word', got {kind!r}")


def _atomic_write(path: Path, data: bytes) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_bytes(data)
  tmp.replace(path)
