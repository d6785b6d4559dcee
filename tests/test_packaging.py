"""The distribution ships every sub-package, and `kernels/` only as `ludic_fast.kernels`."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


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
