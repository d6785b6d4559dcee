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


def import_graph(root: Path = ROOT, lazy: bool = False, within: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (its own submodules left out); with `lazy`, also those
    of another package that it imports anywhere else (inside functions, methods, blocks); with `within` too,
    those of its own package imported anywhere."""
    mods = _modules(root)
    graph = {}
    for m, f in mods.items():
        source = f.read_text(encoding="utf-8")
        deps = _imports(source, mods, lazy=False)
        if lazy:
            deps |= {d for d in _imports(source, mods, lazy=True) if within or _package(d) != _package(m)}
        graph[m] = {d for d in deps if d != m and not d.startswith(m + ".")}
    return graph


def test_no_import_cycles():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_cycles_between_packages_counting_lazy_imports():
    cycle = _cycle(import_graph(lazy=True))
    assert cycle is None, " -> ".join(cycle)


def test_no_cycles_inside_packages_counting_lazy_imports():
    """A deferred import inside one package closes a circle as well: rollout.sampler's registry and the samplers
    that imported their types from it, cli.parallel and cli.dataset_presets, rollout.vllm_server and
    rollout.weight_transfer were the last ones."""
    cycle = _cycle(import_graph(lazy=True, within=True))
    assert cycle is None, " -> ".join(cycle)


def test_the_inside_package_graph_reads_function_level_imports(tmp_path):
    sub = tmp_path / "lf" / "sub"
    sub.mkdir(parents=True)
    for init in (tmp_path / "lf" / "__init__.py", sub / "__init__.py"):
        init.write_text("")
    (sub / "a.py").write_text("from lf.sub.b import f\n")
    (sub / "b.py").write_text("def f():\n    from lf.sub.a import g\n")
    assert _cycle(import_graph(tmp_path / "lf", lazy=True)) is None  # the circle hides behind a function
    assert _cycle(import_graph(tmp_path / "lf", lazy=True, within=True)) == ["lf.sub.a", "lf.sub.b", "lf.sub.a"]


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


def _import_module_calls(source: str) -> set[str]:
    """The literal names of `importlib.import_module("...")` / `__import__("...")` calls anywhere in `source`."""
    return {node.args[0].value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")}


#: what the engine must not know: the objectives it runs and the RL algorithm presets
ENGINE_MUST_NOT_IMPORT = ("ludic_fast.objectives", "ludic_fast.algorithm")


def _engine_violations(mods: dict[str, Path]) -> list[str]:
    """`engine module imports forbidden module` for every import of ENGINE_MUST_NOT_IMPORT by a module of
    ludic_fast.engine: module level, inside functions and methods, or through importlib."""
    out = []
    for m, f in mods.items():
        if m == "ludic_fast.engine" or m.startswith("ludic_fast.engine."):
            source = f.read_text(encoding="utf-8")
            deps = _imports(source, mods, lazy=True) | _import_module_calls(source)
            out += [f"{m} imports {d}" for d in deps
                    if any(d == bad or d.startswith(bad + ".") for bad in ENGINE_MUST_NOT_IMPORT)]
    return sorted(out)


def test_the_engine_imports_no_objective_nor_algorithm():
    """No module of ludic_fast/engine/ imports ludic_fast.objectives or ludic_fast.algorithm, at module level,
    inside a function or lazily: the engine runs any `Objective` and knows none."""
    assert _engine_violations(_modules()) == []


def test_the_engine_check_sees_function_level_and_lazy_imports(tmp_path):
    mods = _modules()
    for source in ("def f():\n    from ludic_fast.objectives.rl import RLObjective\n",
                   "import importlib\nX = importlib.import_module('ludic_fast.algorithm')\n",
                   "from ludic_fast import algorithm\n",
                   "class A:\n    def g(self):\n        import ludic_fast.objectives\n"):
        path = tmp_path / "probe.py"
        path.write_text(source, encoding="utf-8")
        assert _engine_violations({**mods, "ludic_fast.engine.probe": path}) != [], source
    path = tmp_path / "fine.py"
    path.write_text("from ludic_fast.engine.objective import Objective\nimport ludic_fast.algorithms_x\n")
    assert _engine_violations({**mods, "ludic_fast.engine.fine": path}) == []


def test_names_moved_to_break_the_circles_import_from_their_former_paths():
    """rollout.sampler's types now live in rollout.sampling and request_json in rollout.http: the former paths
    still give the same objects."""
    from ludic_fast.rollout import http, sampler, sampling, vllm_server

    for name in ("SamplingConfig", "Completion", "cut_at_eos", "Sampler"):
        assert getattr(sampler, name) is getattr(sampling, name)
    assert vllm_server.request_json is http.request_json


#: ludic_fast.reference's public names before it was split into modules by family (head, tokens, ludic_losses,
#: surrogate beside preference and divergence)
REFERENCE_NAMES = (
    "linear_divergence", "CPOLoss", "DPOLoss", "IPOLoss", "KTOLoss", "ORPOLoss", "SimPOLoss", "head_logits",
    "logprobs_from_logits", "linear_logprobs", "linear_cross_entropy", "compute_token_logp", "compute_token_entropy",
    "token_entropy", "compute_logp_action", "ReinforceLoss", "ReinforceBaselineLoss", "MaskedCausalLMCrossEntropyLoss",
    "ClippedSurrogateLoss", "TokenClippedSurrogateLoss", "CISPOLoss", "TokenKLLoss", "KLLoss", "EntropyBonus",
    "LossTerm", "CompositeLoss", "TokenSurrogateLoss", "ZVPCISPOLoss", "ScaleRLLoss", "SAPOLoss", "GSPOTokenLoss",
)


def test_the_reference_keeps_its_public_names():
    import ludic_fast.reference as reference

    assert sorted(reference.__all__) == sorted(REFERENCE_NAMES)
    assert all(callable(getattr(reference, name)) for name in REFERENCE_NAMES)


#: where each name `ludic_fast.cli.train` defined went when it was split by job (parsing, the task and the input
#: checks, the SFT and RL phases, the summary); examples/pipeline_rl, bench/ and the tests import them from cli.train
TRAIN_SPLIT = {
    "train_parser": ("build_parser", "samplers_epilog"),
    "train_task": ("build_task", "eval_on_train", "reasoning_gym_cli_task", "describe_eval", "RG_PREFIX", "prepare"),
    "train_phases": ("build_engine", "build_sampler", "vllm_model_dir", "VLLM_DTYPES", "run_sft", "make_algorithm",
                     "build_rollout_source", "run_rl"),
    "train_summary": ("summarize", "summary_line"),
}


def test_the_train_command_keeps_its_names():
    import importlib

    from ludic_fast.cli import train

    for module, names in TRAIN_SPLIT.items():
        home = importlib.import_module(f"ludic_fast.cli.{module}")
        for name in names:
            assert getattr(train, name) is getattr(home, name), name
            assert name in train.__all__, name
    assert train.build_parser("ludic-fast train").description == importlib.import_module(
        "ludic_fast.cli.train_parser").__doc__  # --help reads as before the split
