"""The datasets a config can name, and how to open one split of each for random access."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import tensorflow_datasets as tfds

from transformer_jax.data import builders
from transformer_jax.data.catalog import DATASETS


# Where each dataset is downloaded from when no data_dir is given (tfds's WMT builders name
# several mirrors; statmt.org is the first).
DOWNLOAD_HOSTS = {
    "fra_eng": builders.FRA_ENG_URL.split("/")[2],
    "multi30k_en_fr": "github.com", "multi30k_en_de": "github.com",
    "wmt14_en_de": "www.statmt.org", "wmt14_en_fr": "www.statmt.org",
    "shakespeare": builders.SHAKESPEARE_URL.split("/")[2],
    "shakespeare_genre": builders.SHAKESPEARE_URL.split("/")[2],
}
# The one file a dataset downloads, where it is one (read when checked: tests point them
# elsewhere).
DOWNLOAD_URLS = {"fra_eng": lambda: builders.FRA_ENG_URL,
                 "shakespeare": lambda: builders.SHAKESPEARE_URL,
                 "shakespeare_genre": lambda: builders.SHAKESPEARE_URL}


def _check_reachable(name: str, host: str | None, timeout: float = 10.0) -> None:
  """Fails fast where a download cannot work, instead of tfds's minutes of retries: the
  dataset's file is asked for its headers where its URL is known (an HTTP error, a 404 say, is
  one line), else its host is connected to."""
  import socket
  import urllib.error
  import urllib.request
  url = DOWNLOAD_URLS.get(name, lambda: None)()
  if host is None and url is None:
    return
  try:
    if url:
      urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    else:
      socket.create_connection((host, 443), timeout=timeout).close()
  except urllib.error.HTTPError as e:
    raise builders.DatasetError(
        f"dataset {name} is not prepared in tfds_dir and its source {url} answered {e.code} "
        f"{e.reason}; set data_dir to a directory with its raw files") from None
  except (OSError, urllib.error.URLError) as e:
    raise builders.DatasetError(
        f"dataset {name} is not prepared in tfds_dir and its source {url or host} cannot be "
        f"reached ({getattr(e, 'reason', e)}); set data_dir to a directory with its raw files"
        ) from None


_HASHED_BYTES = 64 * 2 ** 20  # Larger raw files are known by name, size and time instead.


@functools.lru_cache(maxsize=None)
def source_key(data_dir: str | None, outputs: tuple[str, ...] = ()) -> str:
  """What a prepared dataset is made from: "download" (its public source), or "local-" and a
  digest of the files under `data_dir` (their names and bytes) outside the `outputs`
  directories (tfds_dir and the token cache: what preparing writes, which may lie inside
  data_dir). Datasets and token caches are kept by this key, so that another corpus in the same
  place is prepared anew, never mistaken for the one prepared before."""
  if not data_dir:
    return "download"
  root = Path(data_dir).resolve()
  skipped = [Path(out).resolve() for out in outputs if out]
  inputs = (p for p in root.rglob("*")
            if p.is_file() and not any(p.is_relative_to(out) for out in skipped))
  digest = hashlib.sha256()
  for path in sorted(inputs):
    stat = path.stat()
    digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0".encode())
    if stat.st_size <= _HASHED_BYTES:
      digest.update(path.read_bytes())
    else:
      digest.update(str(stat.st_mtime_ns).encode())
  return "local-" + digest.hexdigest()[:16]


def prepare(name: str, tfds_dir: str, data_dir: str | None, cache_dir: str = ""):
  """Builds (once) the array_record files of a dataset and returns its builder.

  Args:
    name: a key of DATASETS.
    tfds_dir: where tfds keeps prepared datasets (one from a local data_dir goes under
      tfds_dir/local-DIGEST: see source_key).
    data_dir: local directory with the raw files, or None to download them.
    cache_dir: where the token caches go, if not under tfds_dir (not part of the corpus).
  """
  spec = DATASETS[name]
  key = source_key(data_dir or None, (tfds_dir, cache_dir))  # A local corpus: its own directory.
  tfds_dir = tfds_dir if key == "download" else str(Path(tfds_dir) / key)
  if spec.builder is None:
    builder = tfds.builder(spec.tfds_name, data_dir=tfds_dir, file_format="array_record")
  else:
    config = spec.tfds_name.split("/")[1] if "/" in spec.tfds_name else None
    builder = getattr(builders, spec.builder)(data_dir=tfds_dir, config=config,
                                              file_format="array_record")
  if builder.is_prepared():
    return builder
  if not data_dir:
    _check_reachable(name, DOWNLOAD_HOSTS.get(name))
  download_config = tfds.download.DownloadConfig(
      manual_dir=str(Path(data_dir).resolve()) if data_dir else None)
  before = _paths_under(tfds_dir)
  try:
    builder.download_and_prepare(download_config=download_config)
  except KeyboardInterrupt:
    # tfds leaves its partial downloads (*.tmp.*) and folders behind: what this call added goes.
    _remove_new_paths(tfds_dir, before)
    raise
  return builder


def _paths_under(directory: str) -> set[Path]:
  root = Path(directory)
  return {root, *root.rglob("*")} if root.exists() else set()


def _remove_new_paths(directory: str, before: set[Path]) -> None:
  """Removes what is under `directory` (and itself) but not in `before`, deepest first."""
  for path in sorted(_paths_under(directory) - before, key=lambda p: len(p.parts), reverse=True):
    if path.is_dir() and not path.is_symlink():
      shutil.rmtree(path, ignore_errors=True)
    else:
      path.unlink(missing_ok=True)


def tfds_dir_of(cfg) -> str:
  """A DataConfig's tfds_dir (default ~/tensorflow_datasets)."""
  return cfg.tfds_dir or os.path.expanduser("~/tensorflow_datasets")


def prepare_config(cfg):
  """prepare() for a DataConfig: its dataset, from its data_dir (or download), in its
  tfds_dir."""
  return prepare(cfg.dataset, tfds_dir_of(cfg), cfg.data_dir or None, cfg.cache_dir)


class TextPairs:
  """Random access to the (source, target) sentences of one prepared split, to the texts of a
  split of documents (`read` then gives one list: each document's text), or to the (text, label)
  examples of a classifier's split.

  Reads raw records and parses only the text features, about 7x faster than tfds's
  generic decoding. Picklable (it reopens its files), so grain workers can hold one.
  """

  def __init__(self, builder, name: str, split: str):
    from tensorflow_datasets.core import decode
    spec = DATASETS[name]
    self.keys = (("text",) if spec.documents else ("text", "label") if spec.labelled
                 else (spec.src_lang, spec.tgt_lang))
    self.split = split
    try:  # A slice of no records ("train[:0]"): array_record's own words otherwise.
      empty = builder.info.splits[split].num_examples == 0
    except (KeyError, ValueError):
      empty = False  # An unknown split: named below.
    if empty:
      raise builders.DatasetError(f"split {split!r} of {name} holds no "
                                  f"{'documents' if spec.documents else 'pairs'}")
    try:  # An unknown split name.
      self._records = builder.as_data_source(
          split, deserialize_method=decode.DeserializeMethod.RAW_BYTES)
    except ValueError as e:
      raise builders.DatasetError(f"split {split!r} of {name} cannot be read: "
                                  f"{str(e).strip().splitlines()[0]}") from e
    if not len(self._records):
      raise builders.DatasetError(f"split {split!r} of {name} holds no "
                                  f"{'documents' if spec.documents else 'pairs'}")

  def __len__(self) -> int:
    return len(self._records)

  def read(self, indices) -> tuple[list[str], ...]:
    """The source and target sentences (or the documents' texts) of the records at
    `indices`."""
    from tensorflow_datasets.proto import tf_example_pb2
    out = tuple([] for _ in self.keys)
    for record in self._records.__getitems__(list(indices)):
      feature = tf_example_pb2.Example.FromString(record).features.feature
      for texts, key in zip(out, self.keys):
        texts.append(feature[key].bytes_list.value[0].decode("utf-8"))
    return out


def pairs(builder, name: str, split: str) -> list[tuple[str, str]]:
  """Every (source, target) sentence pair of a split; `split` may use tfds slicing, e.g.
  "train[:512]"."""
  text = TextPairs(builder, name, split)
  return pairs_of(text, range(len(text)))


def pairs_of(text: TextPairs, indices) -> list[tuple[str, str]]:
  """The (source, target) pairs at `indices`, read in batches (much faster than one by one)."""
  out = []
  for start in range(0, len(indices), 10_000):
    out.extend(zip(*text.read(indices[start:start + 10_000])))
  return out
