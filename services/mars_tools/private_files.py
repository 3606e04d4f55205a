"""Files that hold a secret or users' text (a master key, traces with opened turn text): readable and
writable by their owner alone, whatever the umask, also when they replace an existing file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO


def open_private(path: str | Path, exclusive: bool = False) -> TextIO:
    """`path` opened for writing text with mode 0600; `exclusive`: FileExistsError rather than replacing.
    A symbolic link at `path` is refused (OSError), never followed: another user's link in a shared folder
    cannot make this write land in a file of their choosing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a file that existed keeps its old mode otherwise
    return os.fdopen(fd, "w")
