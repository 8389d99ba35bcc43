"""The datasets a config can name, and how to open one split of each for random access."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import tensorflow_datasets as tfds

from transformer_jax.data import builders


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  builder: type | None  # A builder of this package, or None for a tfds catalog name.
  tfds_name: str  # Catalog name, with "/config" where the builder has configs.
  src_lang: str
  tgt_lang: str


DATASETS = {
    "fra_eng": DatasetSpec(builders.FraEng, "fra_eng", "en", "fr"),
    "multi30k_en_fr": DatasetSpec(builders.Multi30k, "multi30k/en-fr", "en", "fr"),
    "multi30k_en_de": DatasetSpec(builders.Multi30k, "multi30k/en-de", "en", "de"),
    # tfds's own WMT14 builders need the internet (and a large disk) to prepare.
    "wmt14_en_de": DatasetSpec(None, "wmt14_translate/de-en", "en", "de"),
    "wmt14_en_fr": DatasetSpec(None, "wmt14_translate/fr-en", "en", "fr"),
}


def prepare(name: str, tfds_dir: str, data_dir: str | None):
  """Builds (once) the array_record files of a dataset and returns its builder.

  Args:
    name: a key of DATASETS.
    tfds_dir: where tfds keeps prepared datasets.
    data_dir: local directory with the raw files, or None to download them.
  """
  spec = DATASETS[name]
  if spec.builder is None:
    builder = tfds.builder(spec.tfds_name, data_dir=tfds_dir, file_format="array_record")
  else:
    config = spec.tfds_name.split("/")[1] if "/" in spec.tfds_name else None
    builder = spec.builder(data_dir=tfds_dir, config=config, file_format="array_record")
  download_config = tfds.download.DownloadConfig(
      manual_dir=str(Path(data_dir).resolve()) if data_dir else None)
  builder.download_and_prepare(download_config=download_config)
  return builder


def pairs(builder, name: str, split: str) -> list[tuple[str, str]]:
  """All (source, target) sentence pairs of a split, read through tfds's random-access source.

  `split` may use tfds slicing, e.g. "train[:512]".
  """
  spec = DATASETS[name]
  source = builder.as_data_source(split)
  out = []
  for start in range(0, len(source), 10_000):  # Batched reads are ~15x faster than one by one.
    for ex in source.__getitems__(range(start, min(start + 10_000, len(source)))):
      out.append((ex[spec.src_lang].decode("utf-8"), ex[spec.tgt_lang].decode("utf-8")))
  return out
