"""The command line the docs generators share (tools/gen_api.py, tools/gen_registry_docs.py): write the
generated file, or with `--check` exit 1 when the file on disk differs from what would be written."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_or_check(path: Path, render: Callable[[], str], argv: list[str] | None, *, description: str,
                   script: str) -> int:
    """Parse `argv` (`--check`), render the text and write it to `path`, or with `--check` compare it with the
    file (exit status 1 and a line naming `script` to run when they differ). Returns the exit status."""
    name = path.relative_to(ROOT).as_posix()
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help=f"exit 1 when {name} is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if (path.read_text(encoding="utf-8") if path.exists() else "") != text:
            print(f"{path} is out of date: run python {script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path} ({len(text.splitlines())} lines)")
    return 0
