"""The docs stand on their own: every relative link and every repository path they quote exists, nothing
points at files the project does not ship (design notes, reference notes, issue numbers), the README
points at the generated preset tables, and docs/api.md and docs/presets.md are what their generators write."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("bench/", "docs/", "examples/", "ludic_fast/", "kernels/", "tests/", "tools/")
#: pointers to material outside the shipped project
FORBIDDEN = re.compile(r"\bref/[\w-]+\.md|(?-i:\bDESIGN\b)|\.\./shared|issue notes|\bissue \d+|/work/", re.IGNORECASE)
SOURCES = [
    p
    for p in [*ROOT.glob("ludic_fast/**/*.py"), *ROOT.glob("examples/**/*.py"), *ROOT.glob("tools/*.py"),
              *ROOT.glob("tests/**/*.py")]
    if p.name != "test_docs.py"
]


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_quoted_paths_exist(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for link in _links(text):
        if re.match(r"[a-z]+://|mailto:|#", link):
            continue
        target = (doc.parent / link.split("#")[0]).resolve()
        if not target.exists():
            missing.append(link)
    for quoted in re.findall(r"`([^`\s]+)`", text):
        path = quoted.split("::")[0].split(":")[0].rstrip(".,;")
        if path.startswith(TOP_DIRS) and "<" not in path and "*" not in path and not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{doc.name}: dangling references {missing}"


@pytest.mark.parametrize("path", DOCS + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pointers_outside_the_project(path):
    hits = [m.group(0) for m in FORBIDDEN.finditer(path.read_text(encoding="utf-8"))]
    assert not hits, f"{path.relative_to(ROOT)} points outside the project: {hits}"


def test_cli_help_stands_on_its_own_and_the_docs_preset_lists_are_the_registry():
    """--help says nothing outside the project; the README points at the generated tables (docs/presets.md) and
    a hand-written list of offline presets (docs/preference.md) names exactly the registry's."""
    from ludic_fast.cli import train as train_cli
    from ludic_fast.cli.presets import PRESETS

    text = train_cli.build_parser("ludic-fast train").format_help()
    assert not FORBIDDEN.search(text)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/presets.md)" in readme
    preference = (ROOT / "docs" / "preference.md").read_text(encoding="utf-8")
    offline = re.search(r"--preset ((?:\w+\|)+\w+)", preference).group(1).split("|")
    assert sorted(offline) == sorted(p.name for p in PRESETS if p.offline)


def test_api_reference_generator_covers_its_modules():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "tools" / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    for module, _ in gen.MODULES:
        assert f"## `{module}`" in text
    assert "linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor" in text
    assert " at 0x" not in text  # no memory addresses: the output is the same on every run


def test_api_reference_is_up_to_date():
    """`tools/gen_api.py --check` passes: docs/api.md is what the docstrings generate (run `make docs`)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_api.py"), "--check"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


def test_registry_tables_are_up_to_date():
    """`tools/gen_registry_docs.py --check` passes: docs/presets.md is what the registries generate (`make docs`)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_registry_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
