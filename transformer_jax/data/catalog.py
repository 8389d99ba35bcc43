"""The datasets a config can name: what `data.dataset` may say and the languages of each,
readable without tensorflow-datasets: `translate` loads tfds only to read a split (`--split`)
and `serve` never; both ask a workdir's dataset for its source language. How a split is built
and read: sources.py."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  builder: str | None  # A class of data/builders.py, or None for a tfds catalog name.
  tfds_name: str  # Catalog name, with "/config" where the builder has configs.
  src_lang: str
  tgt_lang: str
  documents: bool = False  # Monolingual documents (a language model's corpus), not pairs.
  labelled: bool = False  # Texts and their labels (a classifier's corpus), not pairs.


DATASETS = {
    "fra_eng": DatasetSpec("FraEng", "fra_eng", "en", "fr"),
    "multi30k_en_fr": DatasetSpec("Multi30k", "multi30k/en-fr", "en", "fr"),
    "multi30k_en_de": DatasetSpec("Multi30k", "multi30k/en-de", "en", "de"),
    # tfds's own WMT14 builders need the internet (and a large disk) to prepare.
    "wmt14_en_de": DatasetSpec(None, "wmt14_translate/de-en", "en", "de"),
    "wmt14_en_fr": DatasetSpec(None, "wmt14_translate/fr-en", "en", "fr"),
    # A local corpus of train.tsv / validation.tsv (e.g. benchmarks/synthetic_corpus.py's).
    "parallel_tsv": DatasetSpec("ParallelTsv", "parallel_tsv", "src", "tgt"),
    # Language models: documents held out whole (builders.document_splits).
    "shakespeare": DatasetSpec("TextDocuments", "text_documents/shakespeare", "en", "en",
                               documents=True),
    # A local corpus: a directory of *.txt (or *.lines.txt) files.
    "text_documents": DatasetSpec("TextDocuments", "text_documents/local", "", "",
                                  documents=True),
    # Classifiers: passages of the plays labelled comedy, history or tragedy (First Folio).
    "shakespeare_genre": DatasetSpec("LabelledText", "labelled_text/shakespeare_genre", "en", "",
                                     labelled=True),
    # A local corpus: train / validation (/ test) files of text<TAB>label or JSON lines.
    "labelled_text": DatasetSpec("LabelledText", "labelled_text/local", "", "", labelled=True),
}
