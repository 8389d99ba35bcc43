"""The raw corpora and the test sets from their public sources, laid out as the directories the
configs' `data.data_dir` and the README's commands read:

  OUT/fra-eng/fra-eng.zip                      d2l's fra-eng corpus (configs/fra_eng.py)
  OUT/multi30k/{train,val,test_2016_flickr}.{en,fr,de}.gz   Multi30k task 1 (configs/multi30k.py)
  OUT/en-fr-test/NAME.{eng,fra}               held-out test sets, line-aligned:
      tatoeba-test-v2021-08-07.disjoint-from-fra-eng   Tatoeba's 2021-08-07 test release less
                                                       every pair sharing a side with fra.txt
      newstest2014, multi30k_test_2016_flickr          out-of-domain sets

The test sets come from Helsinki-NLP/OPUS-MT-testsets at a fixed commit, and each file written
is checked against the sha256 of the file the project's figures were measured on: a download
that differs is an error, not a silently different test set.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from transformer_jax import fs
from transformer_jax.data.builders import FRA_ENG_URL, MULTI30K_URL, normalize
from transformer_jax.errors import UserError

SETS = ("fra-eng", "multi30k", "en-fr-test")
OPUS_TESTSETS = ("https://raw.githubusercontent.com/Helsinki-NLP/OPUS-MT-testsets/"
                 "ac0f19c0be3cb4e0d9450fcb2d7a9847c4bdd180/testsets/eng-fra/{name}")
TATOEBA = "tatoeba-test-v2021-08-07"
DISJOINT = f"{TATOEBA}.disjoint-from-fra-eng"
FRA_TXT = "fra-eng/fra.txt"  # The member of fra-eng.zip.
MULTI30K_LINES = {"train": 29_000, "val": 1_014, "test_2016_flickr": 1_000}

# sha256 of the files the project's figures were measured on (fra.txt: the zip's member).
SHA256 = {
    FRA_TXT: "0bb85dbaa1c896844649094d7eaf2e34bee34e84fe362b26ce7e8f2e12aae104",
    f"{DISJOINT}.eng": "121a98cea544dc94181839eac173fe424e370ae1d83ccc567c7b43f5d750d176",
    f"{DISJOINT}.fra": "94ce4467a2121756903fa2d37f57498031db0975dbe5c9513e84a1b42d6869f3",
    "newstest2014.eng": "9a12cb6e8efb3509ebede627e4a9c83ee64935509d561ff70f4b7bd5f93f6096",
    "newstest2014.fra": "2bd07dc204f965bf88e90adb6223a8cb850f9bf9840df6af1f4945195936656e",
    "multi30k_test_2016_flickr.eng":
        "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "multi30k_test_2016_flickr.fra":
        "cb3160d69b002bb638e66cc7612fcd56cb0af82eadc9c142dedc438afb885ef6",
}


class DownloadError(UserError, OSError):
  """A source that cannot be fetched, or fetched content that is not what it should be."""

  def __str__(self) -> str:
    return self.args[0]


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _check_sha256(name: str, data: bytes, source: str) -> None:
  if _sha256(data) != SHA256[name]:
    raise DownloadError(f"{name} from {source} is not the file the project's figures were "
                        f"measured on (sha256 {_sha256(data)[:16]}..., expected "
                        f"{SHA256[name][:16]}...); nothing of it was written")


def _key(text: str) -> str:
  """A sentence as the disjointness check compares it: d2l's space normalization, case and
  runs of spaces ignored."""
  return " ".join(normalize(text).lower().split())


def disjoint(test: Iterable[tuple[str, str]], corpus: Iterable[tuple[str, str]]
             ) -> list[tuple[str, str]]:
  """The test pairs neither of whose sides occurs in the corpus (as `_key` compares them), in
  their order: a model trained on the corpus has seen no sentence of what is left."""
  english, french = set(), set()
  for en, fr in corpus:
    english.add(_key(en))
    french.add(_key(fr))
  return [(en, fr) for en, fr in test if _key(en) not in english and _key(fr) not in french]


def fra_eng_pairs(zip_bytes: bytes) -> list[tuple[str, str]]:
  """The (English, French) pairs of d2l's fra-eng.zip."""
  text = zipfile.ZipFile(io.BytesIO(zip_bytes)).read(FRA_TXT).decode("utf-8")
  return [tuple(line.split("\t")[:2]) for line in text.splitlines() if line.count("\t") >= 1]


def _lines(data: bytes) -> list[str]:
  text = data.decode("utf-8")
  return text[:-1].split("\n") if text.endswith("\n") else text.split("\n")


class _Fetcher:
  """Reads each source from its URL, or from a local directory holding the same files under
  their own names (`mirror`: a copy made elsewhere, for a machine without internet)."""

  def __init__(self, mirror: str | Path | None, log: Callable[[str], None]):
    self.mirror, self.log = mirror and Path(mirror), log
    if self.mirror and not self.mirror.is_dir():
      raise DownloadError(f"--mirror {mirror} is not a directory")

  def __call__(self, url: str) -> bytes:
    name = url.rsplit("/", 1)[-1]
    if self.mirror:
      path = self.mirror / name
      if not path.is_file():
        raise DownloadError(f"--mirror {self.mirror} holds no {name}")
      return path.read_bytes()
    self.log(f"Downloading {url}")
    try:
      with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()
    except (urllib.error.URLError, OSError) as e:
      reason = getattr(e, "reason", e)
      raise DownloadError(f"cannot download {url} ({reason}); without internet, copy the files "
                          "from a machine that has it and pass --mirror DIR") from None


def _fra_eng_files(fetch: _Fetcher) -> dict[str, bytes]:
  data = fetch(FRA_ENG_URL)
  try:
    member = zipfile.ZipFile(io.BytesIO(data)).read(FRA_TXT)
  except (zipfile.BadZipFile, KeyError) as e:
    raise DownloadError(f"fra-eng.zip is not d2l's corpus ({e})") from None
  _check_sha256(FRA_TXT, member, "fra-eng.zip")
  return {"fra-eng/fra-eng.zip": data}


def _multi30k_files(fetch: _Fetcher) -> dict[str, bytes]:
  files = {}
  for stem, count in MULTI30K_LINES.items():
    for lang in ("en", "fr", "de"):
      data = fetch(MULTI30K_URL.format(name=f"{stem}.{lang}"))
      try:
        lines = gzip.decompress(data).count(b"\n")
      except (OSError, EOFError) as e:
        raise DownloadError(f"Multi30k's {stem}.{lang}.gz is not gzip ({e})") from None
      if lines != count:
        raise DownloadError(f"Multi30k's {stem}.{lang}.gz has {lines} lines, not {count}")
      files[f"multi30k/{stem}.{lang}.gz"] = data
  return files


def _test_files(fetch: _Fetcher, fra_eng_zip: bytes) -> dict[str, bytes]:
  files = {}
  for stem in ("newstest2014", "multi30k_test_2016_flickr"):
    for lang in ("eng", "fra"):
      data = fetch(OPUS_TESTSETS.format(name=f"{stem}.{lang}"))
      _check_sha256(f"{stem}.{lang}", data, "OPUS-MT-testsets")
      files[f"en-fr-test/{stem}.{lang}"] = data
  english, french = (_lines(fetch(OPUS_TESTSETS.format(name=f"{TATOEBA}.{lang}")))
                     for lang in ("eng", "fra"))
  if len(english) != len(french):
    raise DownloadError(f"{TATOEBA}.eng has {len(english)} lines and .fra {len(french)}; "
                        "they must be aligned")
  kept = disjoint(zip(english, french), fra_eng_pairs(fra_eng_zip))
  for lang, side in (("eng", 0), ("fra", 1)):
    data = "".join(pair[side] + "\n" for pair in kept).encode("utf-8")
    _check_sha256(f"{DISJOINT}.{lang}", data, f"{TATOEBA} less fra.txt's sentences")
    files[f"en-fr-test/{DISJOINT}.{lang}"] = data
  return files


def download(out: str | Path, sets: Iterable[str] = SETS, mirror: str | Path | None = None,
             log: Callable[[str], None] = print) -> list[Path]:
  """Writes the files of `sets` under `out`; returns those written.

  Every file is fetched and checked before any is written; a file already in `out` with the
  same content is left as it is, and one with other content stops the command (it is the
  user's: nothing is overwritten).

  Raises:
    DownloadError: a source cannot be fetched, or is not what the project measured on, or a
      file in `out` differs from it.
  """
  out, sets = Path(out), list(sets)
  unknown = [s for s in sets if s not in SETS]
  if unknown or not sets:
    raise DownloadError(f"--sets {','.join(sets)!r}: choose among {', '.join(SETS)}")
  fetch = _Fetcher(mirror, log)
  files: dict[str, bytes] = {}
  if "fra-eng" in sets or "en-fr-test" in sets:
    fra_eng = _fra_eng_files(fetch)
    if "fra-eng" in sets:
      files.update(fra_eng)
  if "multi30k" in sets:
    files.update(_multi30k_files(fetch))
  if "en-fr-test" in sets:
    files.update(_test_files(fetch, fra_eng["fra-eng/fra-eng.zip"]))
  for name, data in files.items():
    path = out / name
    if path.exists() and (not path.is_file() or path.read_bytes() != data):
      raise DownloadError(f"{path} exists and differs from the file to write; move it away "
                          "(nothing was written)")
  fs.check_writable(out, "--out")
  written = []
  for name, data in sorted(files.items()):
    path = out / name
    if path.exists():
      log(f"{path}: already there")
      continue
    path.parent.mkdir(parents=True, exist_ok=True)
    fs.replace_file(path, data)
    written.append(path)
    log(f"{path}: {len(data):,} bytes")
  return written
