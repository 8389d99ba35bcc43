"""The file-system checks commands make before any work (an OSError met later, a disk that
fills or a directory that goes away, is worded by errors.describe_os_error)."""

from __future__ import annotations

import tempfile
from pathlib import Path

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
