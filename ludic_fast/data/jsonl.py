"""JSONL input: one JSON object per line, blank lines skipped; a bad line is a ValueError naming `file:line`.

Every reader of JSONL (tasks, offline rollouts and chat data, a JSONLLogger's records) goes through
`jsonl_objects`, so a malformed file gets the same one-line error wherever it is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def jsonl_objects(path: str | os.PathLike[str]) -> list[tuple[int, dict[str, Any]]]:
    """`(line number, object)` for every non-blank line of `path` (numbers from 1). ValueError
    `"<path>:<line>: not a JSON object (...)"` for a line that is not JSON or not an object."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON object ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: not a JSON object (a {type(obj).__name__})")
        rows.append((n, obj))
    return rows


__all__ = ["jsonl_objects"]
