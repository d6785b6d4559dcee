"""The distribution ships every sub-package, and `kernels/` only as `ludic_fast.kernels`; `make test-oldest`
pins every requirement floor."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _oldest_pins() -> dict[str, Version]:
    lines = (ROOT / "tests" / "constraints-oldest.txt").read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in reqs)
    return {canonicalize_name(r.name): Version(next(iter(r.specifier)).version) for r in reqs}


def test_every_subpackage_is_listed():
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ludic_fast").rglob("__init__.py")
    } | {"ludic_fast.kernels"}
    assert set(_setuptools_config()["packages"]) == on_disk


def test_kernels_installed_under_ludic_fast_only():
    cfg = _setuptools_config()
    assert cfg["package-dir"]["ludic_fast.kernels"] == "kernels"
    assert "kernels" not in cfg["packages"]
    assert (ROOT / "kernels" / "__init__.py").exists()


def test_oldest_constraints_pin_every_floor():
    """Every core requirement is pinned, and every `>=` floor (core and extras) is pinned at the floor itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = [Requirement(r) for r in project["dependencies"]]
    extras = [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    floors = {
        canonicalize_name(r.name): Version(spec.version)
        for r in core + extras
        for spec in r.specifier
        if spec.operator == ">="
    }
    pins = _oldest_pins()
    assert {canonicalize_name(r.name) for r in core} <= pins.keys()
    assert {"torch", "triton", "transformers", "trl"} <= floors.keys()
    assert {name: pins.get(name) for name in floors} == floors


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_gitignore_matches_no_tracked_file():
    """A tracked file that .gitignore matches is one whose siblings `git add` would silently leave out."""
    ignored = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert ignored == [], f".gitignore matches tracked files: {ignored}"
