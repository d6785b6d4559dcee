"""Atomic file writes: readers of the path only ever see the old or the complete new file.

The text goes to a temp file in the same directory, which is fsynced and renamed over the path
(`os.replace`), then the directory is fsynced, so a crash at any point leaves one whole file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write `data` as JSON to `path` so that readers only ever see the old or the complete new file."""
    atomic_write_text(path, json.dumps(data, sort_keys=True))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` so that readers only ever see the old or the complete new file (temp file in
    the same directory, fsync, rename, fsync of the directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = ["atomic_write_json", "atomic_write_text"]
