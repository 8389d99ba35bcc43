"""The file-system checks commands make before any work (an OSError met later, a disk that
fills or a directory that goes away, is worded by errors.describe_os_error)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from transformer_jax import errors
from transformer_jax.errors import UserError


class NotWritableError(UserError, OSError):
  """A file or directory a command is to write cannot be written."""

  def __str__(self) -> str:
    return self.args[0]


def check_writable(path: str | Path, what: str) -> None:
  """Raises NotWritableError, naming `what` (e.g. "--workdir"), where `path` (a directory, or
  a file to create or replace) could not be written: the nearest existing directory at or
  above it takes no new file. Nothing is left behind."""
  path = Path(path).absolute()
  existing = next(p for p in (path, *path.parents) if p.exists())
  if existing == path and path.is_file():  # A file to replace: its directory takes the new one.
    existing = path.parent
  if not existing.is_dir():
    raise NotWritableError(f"{what} {path} cannot be created: {existing} is a file")
  try:
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    raise NotWritableError(f"{what} {path} cannot be written: {e.strerror} (in {existing})"
                           ) from None


def check_output_file(path: str | Path, what: str) -> None:
  """Raises NotWritableError, naming `what` (e.g. "--json"), where `path` cannot be written as
  a file: a directory, a file in a directory that does not exist, or one not writable. Made
  before the work whose result it is to hold."""
  p = Path(path)
  if p.is_dir():
    raise NotWritableError(f"{what} {path} is a directory; name a file")
  if not p.absolute().parent.is_dir():
    raise NotWritableError(f"{what} {path}: directory {p.absolute().parent} does not exist")
  check_writable(p, what)


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_replaceable(path: str | Path, what: str, kind: str) -> None:
  """Raises NotWritableError where `path` is an existing file that is not of the `kind`
  ("text" or "png") the command writes: a corpus, a tokenizer model or a run's log would be
  replaced by what was meant for a new file. A missing path, or one not a regular file
  (/dev/null), passes."""
  p = Path(path)
  if not p.is_file():
    return
  with open(p, "rb") as f:
    head = f.read(1 << 16)
  if kind == "png":
    ok = not head or head.startswith(_PNG_MAGIC)
  else:
    try:
      head.decode("utf-8")
      ok = b"\0" not in head
    except UnicodeDecodeError as e:
      ok = e.start > len(head) - 4  # A character cut by the 64 KB read.
  if not ok:
    raise NotWritableError(f"{what} {path} exists and is not a {'PNG' if kind == 'png' else kind} "
                           "file: it would be overwritten; name a new file")


@contextlib.contextmanager
def new_directory(output: str | Path):
  """Yields a new, empty directory beside `output`, renamed to `output` when the block
  completes and removed when it does not. Its name is made afresh (`.NAME.partial-XXXX`), so
  that nothing a user owns is ever cleared to make room for it, and nothing half-written is
  left at `output`."""
  output = Path(output)
  output.parent.mkdir(parents=True, exist_ok=True)
  partial = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
  try:
    yield partial
    errors.raise_if_interrupted()  # A Ctrl-C that reached no Python frame still counts.
    if output.exists():  # Made by someone else meanwhile: theirs stays.
      raise NotWritableError(f"{output} appeared while it was being written; nothing of it "
                             "was changed")
    _open_to_the_umask(partial)
    partial.rename(output)
  finally:
    shutil.rmtree(partial, ignore_errors=True)


def umask() -> int:
  """The process's umask, read without changing it (Linux: /proc/self/status)."""
  try:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith("Umask:"):
        return int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)  # Elsewhere: set and restored at once.
  os.umask(mask)
  return mask


def _open_to_the_umask(directory: Path) -> None:
  """Gives `directory` and everything in it the permissions a user's umask allows (mkdtemp
  makes a directory 0700, and some writers make their files 0600: another account, or a
  service running as one, could not read what a command wrote)."""
  mask = umask()
  for root, dirs, files in os.walk(directory):
    os.chmod(root, 0o777 & ~mask)
    for name in files:
      path = os.path.join(root, name)
      if not os.path.islink(path):
        executable = stat.S_IMODE(os.stat(path).st_mode) & 0o111
        os.chmod(path, (0o666 | executable) & ~mask)


def replace_file(path: str | Path, data: bytes) -> None:
  """Writes `data` to `path` whole or not at all: into a new file beside it (a fresh name, so
  no other file is touched), then renamed over `path`. A symlink at `path` is written
  through: the file it names is replaced and the link stays. A replaced file keeps its
  permission bits; a new one gets what `open` would give it (0666 less the umask)."""
  path = Path(os.path.realpath(path))
  try:
    mode = stat.S_IMODE(path.stat().st_mode)
  except FileNotFoundError:
    mode = None
  while True:
    partial = path.with_name(f".{path.name}.partial-{secrets.token_hex(4)}")
    try:
      handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
      break
    except FileExistsError:
      continue
  try:
    with open(handle, "wb") as f:
      f.write(data)
    if mode is not None:
      os.chmod(partial, mode)
    partial.replace(path)
  finally:
    partial.unlink(missing_ok=True)
