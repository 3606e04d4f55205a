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


def test_a_link_at_the_path_is_refused_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "someone-elses-file"
    target.write_text("theirs")
    link = tmp_path / "traces.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError):
        open_private(link)
    assert target.read_text() == "theirs"


def test_a_redrive_writes_its_traces_private(tmp_path: Path) -> None:
    """`mars replay run --traces` writes opened turn text: 0600 whatever the umask."""
    from mars_tools.replay.redrive import _write_traces
    from mars_tools.replay.traces import TraceBuilder

    old_umask = os.umask(0o022)
    try:
        _write_traces(tmp_path / "traces", "recorded", TraceBuilder())
    finally:
        os.umask(old_umask)
    assert (tmp_path / "traces" / "recorded.jsonl").stat().st_mode & 0o777 == 0o600


def test_local_certificates_and_keys_are_0600_from_the_start(tmp_path: Path) -> None:
    """mars_stack.certs writes every key file with mode 0600 at creation (no window at the umask's 0644)."""
    from mars_stack import certs

    modes: list[int] = []
    real_open = os.open

    def watching(path: str, flags: int, mode: int = 0o777, *args: object) -> int:
        modes.append(mode)
        return real_open(path, flags, mode)

    old_umask = os.umask(0o022)
    try:
        import unittest.mock

        with unittest.mock.patch.object(certs.os, "open", watching):
            made = certs.make_local_ca(tmp_path / "tls")
    finally:
        os.umask(old_umask)
    assert modes and set(modes) == {0o600}
    assert made.server_key.stat().st_mode & 0o777 == 0o600
