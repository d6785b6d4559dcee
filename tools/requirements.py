"""Print, one per line, the requirements in pyproject.toml: the project's dependencies and those of each extra
named on the command line (`python tools/requirements.py dev bench`). make's venv builds install them, then the
project itself with `pip install --no-deps -e .`: only that last step writes in the tree (ludic_fast.egg-info),
so builds running at once take turns there alone, not for their whole dependency install."""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    """The dependencies, then each extra's in the order named; an unknown extra is refused."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"requirements.py: no extra {', '.join(unknown)} in {PYPROJECT} (has {', '.join(optional)})")
    out = list(project["dependencies"])
    for extra in extras:
        for req in optional[extra]:
            if req.lower().replace("_", "-").startswith(project["name"]):  # would need the project's own extras
                raise SystemExit(f"requirements.py: extra {extra!r} names the project itself ({req}): not expanded")
            out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
