"""Download the wheels verifiers 0.4's `null` harness program needs, so that `make test` prepares that program
without the network.

verifiers prepares the program with `uv sync --script` over its PEP 723 dependencies (unpinned: openai, mcp, httpx,
...), which asks the package index at every test run; a network blip there failed a CI run. `make test` points uv
at the wheels this writes (`UV_FIND_LINKS`) and at an empty local index (`UV_DEFAULT_INDEX`), so the program is
built from what pip downloaded with the venv.

    python tools/harness_wheels.py DIR    # DIR/wheels: the wheels; DIR/empty-index: the empty index
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

SCRIPT_START, SCRIPT_END = "# /// script", "# ///"


def script_dependencies(program: str) -> list[str]:
    """The `dependencies` of a program's PEP 723 `# /// script` block."""
    lines = program.splitlines()
    if SCRIPT_START not in lines:
        raise ValueError("the program has no '# /// script' block")
    start = lines.index(SCRIPT_START) + 1
    end = lines.index(SCRIPT_END, start)
    return tomllib.loads("\n".join(line[2:] for line in lines[start:end]))["dependencies"]


def main(out: Path) -> None:
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM

    (out / "empty-index").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(out / "wheels"),
                    *script_dependencies(CHAT_PROGRAM)], check=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/harness_wheels.py DIR")
    main(Path(sys.argv[1]))
