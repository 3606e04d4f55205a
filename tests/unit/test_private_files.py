"""Files with secrets or users' text are their owner's alone (mars_tools.private_files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mars_tools.private_files import open_private


def test_a_private_file_is_0600_even_where_a_readable_one_was(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        fresh = tmp_path / "traces.jsonl"
        with open_private(fresh) as fh:
            fh.write("opened text\n")
        assert fresh.stat().st_mode & 0o777 == 0o600
        existing = tmp_path / "old.jsonl"
        existing.write_text("x")
        existing.chmod(0o644)
        with open_private(existing) as fh:
            fh.write("new")
        assert existing.stat().st_mode & 0o777 == 0o600 and existing.read_text() == "new"
    finally:
        os.umask(old_umask)


def test_exclusive_never_replaces(tmp_path: Path) -> None:
    key = tmp_path / "master.key"
    key.write_text("keep me")
    with pytest.raises(FileExistsError):
        open_private(key, exclusive=True)
    assert key.read_text() == "keep me"
