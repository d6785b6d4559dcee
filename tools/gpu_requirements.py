"""Print, one per line, the requirements of the installed ludic-fast (and pytest, for the GPU suite) that this
interpreter lacks or holds at a version outside the range: what `make test-gpu` installs. torch and triton
are never printed: a GPU machine's own builds are used as they are (a pip resolve could replace them with
another build)."""

from __future__ import annotations

import importlib.metadata as md

from packaging.requirements import Requirement

KEEP = {"torch", "triton"}


def missing() -> list[str]:
    reqs = [Requirement(r) for r in md.requires("ludic-fast") or []] + [Requirement("pytest")]
    out = []
    for req in reqs:
        if req.name.lower() in KEEP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            out.append(str(req))
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(missing()))
