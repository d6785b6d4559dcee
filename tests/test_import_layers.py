"""No module of ludic_fast imports one that imports it back, at module level (imports inside functions are
not counted): the layers read one way (`cli -> engine <-> objectives -> losses -> ops -> kernels`, data and
rollout feeding the objectives). A package importing its own submodules, and `from pkg import submodule`, are
not cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ludic_fast"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module in mods:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
            out |= subs if len(subs) == len(node.names) else subs | {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycles():
    mods = _modules()
    graph = {m: {d for d in _imports(f, mods) if d != m and not d.startswith(m + ".")} for m, f in mods.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_detector_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
