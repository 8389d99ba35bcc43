"""fs.replace_file: a file is replaced whole, through a symlink, keeping its permissions."""

from __future__ import annotations

import os
import stat

from transformer_jax import fs


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_umasks(tmp_path):
  kept = tmp_path / "kept.txt"
  kept.write_text("old")
  os.chmod(kept, 0o640)
  fs.replace_file(kept, b"new")
  assert kept.read_bytes() == b"new" and _mode(kept) == 0o640

  umask = os.umask(0o022)
  try:
    fs.replace_file(tmp_path / "new.txt", b"made")
  finally:
    os.umask(umask)
  assert _mode(tmp_path / "new.txt") == 0o644
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "new.txt"]


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
  (tmp_path / "elsewhere").mkdir()
  target = tmp_path / "elsewhere" / "translations.txt"
  target.write_text("old")
  link = tmp_path / "link.txt"
  link.symlink_to(target)
  fs.replace_file(link, b"new")
  assert link.is_symlink() and os.readlink(link) == str(target)
  assert target.read_bytes() == b"new"
  assert sorted(p.name for p in target.parent.iterdir()) == ["translations.txt"]
