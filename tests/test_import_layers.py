"""The layers of ludic_fast read one way (`cli -> engine <-> objectives -> losses -> ops -> kernels`, data and
rollout feeding the objectives):

- no module imports one that imports it back at module level;
- nor with the imports of another package (`ludic_fast.X`; a top-level module is its own) written inside
  functions, methods or blocks counted too (lazy imports, a module `__getattr__`): a circle between
  packages cannot hide behind a deferred import.

A package importing its own submodules, and `from pkg import submodule`, are not cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ludic_fast"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(source: str, mods: dict[str, Path] | set[str], lazy: bool) -> set[str]:
    """The modules of `mods` that `source` imports: at module level, or with `lazy` anywhere (every import
    statement of every function, method and block)."""
    tree = ast.parse(source)
    nodes = ast.walk(tree) if lazy else tree.body
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module in mods:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
            out |= subs if len(subs) == len(node.names) else subs | {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
    return out


def _package(module: str) -> str:
    """`ludic_fast.losses.preference.dpo` -> `ludic_fast.losses`; `ludic_fast` stays itself."""
    return ".".join(module.split(".")[:2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
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


def import_graph(root: Path = ROOT, lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (its own submodules left out); with `lazy`, also those
    of another package that it imports anywhere else (inside functions, methods, blocks)."""
    mods = _modules(root)
    graph = {}
    for m, f in mods.items():
        source = f.read_text(encoding="utf-8")
        deps = _imports(source, mods, lazy=False)
        if lazy:
            deps |= {d for d in _imports(source, mods, lazy=True) if _package(d) != _package(m)}
        graph[m] = {d for d in deps if d != m and not d.startswith(m + ".")}
    return graph


def test_no_import_cycles():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_cycles_between_packages_counting_lazy_imports():
    cycle = _cycle(import_graph(lazy=True))
    assert cycle is None, " -> ".join(cycle)


def test_the_detector_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_lazy_imports_are_read_inside_functions_and_methods():
    """The circle that `ludic_fast.losses` once closed with `preference` through a module `__getattr__`."""
    source = (
        "import ludic_fast.ops\n"
        "def __getattr__(name):\n"
        "    from ludic_fast import preference\n"
        "    return getattr(preference, name)\n"
        "class C:\n"
        "    def m(self):\n"
        "        if True:\n"
        "            import ludic_fast.data\n"
    )
    mods = {"ludic_fast", "ludic_fast.ops", "ludic_fast.preference", "ludic_fast.data"}
    assert _imports(source, mods, lazy=False) == {"ludic_fast.ops"}
    assert _imports(source, mods, lazy=True) == {"ludic_fast.ops", "ludic_fast.preference", "ludic_fast.data"}
    graph = {"ludic_fast.losses": {"ludic_fast.preference"}, "ludic_fast.preference": {"ludic_fast.losses"}}
    assert _cycle(graph) == ["ludic_fast.losses", "ludic_fast.preference", "ludic_fast.losses"]
