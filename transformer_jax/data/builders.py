"""tensorflow-datasets builders for the corpora the configs train on.

Each builder reads its raw files from the manual directory when one is given
(`DownloadConfig(manual_dir=...)`, the config's `data_dir`) and downloads them from their
public source otherwise. Both prepare array_record files, which grain reads with random access.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zipfile
from pathlib import Path

import tensorflow_datasets as tfds

FRA_ENG_URL = "http://d2l-data.s3-accelerate.amazonaws.com/fra-eng.zip"
MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{name}.gz"


def normalize(text: str) -> str:
  """d2l's normalization: narrow and non-breaking spaces become plain spaces."""
  return text.replace("\u202f", " ").replace("\xa0", " ").strip()


def split_of(english: str) -> str:
  """Deterministic split by English sentence: 96% train, 2% validation, 2% test.

  Every translation of one English sentence lands in the same split.
  """
  bucket = int(hashlib.md5(english.encode("utf-8")).hexdigest(), 16) % 100
  return "train" if bucket < 96 else ("validation" if bucket < 98 else "test")


def _manual_dir(dl_manager) -> Path | None:
  try:
    return Path(dl_manager.manual_dir)
  except (AssertionError, ValueError):  # No manual directory given, or it is empty.
    return None


class FraEng(tfds.core.GeneratorBasedBuilder):
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
    return {split: self._generate_examples(source, split)
            for split in ("train", "validation", "test")}

  def _generate_examples(self, source: Path, split: str):
    for i, line in enumerate(_read_fra_txt(source)):
      fields = line.rstrip("\n").split("\t")
      if len(fields) < 2:
        continue
      en, fr = normalize(fields[0]), normalize(fields[1])
      if en and fr and split_of(en) == split:
        yield i, {"en": en, "fr": fr}


def _read_fra_txt(source: Path):
  if source.suffix == ".zip":
    with zipfile.ZipFile(source) as zf:
      member = next(n for n in zf.namelist() if n.endswith("fra.txt"))
      with zf.open(member) as f:
        yield from io.TextIOWrapper(f, encoding="utf-8")
  else:
    with open(source, encoding="utf-8") as f:
      yield from f


class Multi30k(tfds.core.GeneratorBasedBuilder):
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
    with gzip.open(en_path, "rt", encoding="utf-8") as fe, \
         gzip.open(tgt_path, "rt", encoding="utf-8") as ft:
      for i, (en, tgt) in enumerate(zip(fe, ft)):
        yield i, {"en": normalize(en), self._target: normalize(tgt)}


class ParallelTsv(tfds.core.GeneratorBasedBuilder):
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
        splits[split] = self._generate_examples(path)
      elif split != "test":
        raise FileNotFoundError(f"data_dir {manual} has no {split}.tsv")
    return splits

  def _generate_examples(self, path: Path):
    with open(path, encoding="utf-8") as f:
      for i, line in enumerate(f):
        src, _, tgt = line.rstrip("\n").partition("\t")
        yield i, {"src": src, "tgt": tgt}
