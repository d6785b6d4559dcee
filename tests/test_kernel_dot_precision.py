"""Every tl.dot of the Triton kernels names its input precision: for fp32 operands Triton's default on NVIDIA
GPUs is tf32 (10-bit mantissa), which the interpreter does not emulate, so a call without it would pass the
interpreter tests and lose fp32 exactness on CUDA only. The launchers pass "ieee" for fp32
(`ludic_fast.ops.triton_head`)."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def _dot_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "dot" and isinstance(n.func.value, ast.Name) and n.func.value.id == "tl"]


def test_every_tl_dot_names_its_input_precision():
    calls = {f"{path.name}:{c.lineno}": c for path in sorted(KERNELS.glob("*.py"))
             for c in _dot_calls(ast.parse(path.read_text()))}
    assert calls, "no tl.dot found: the scan is broken"
    missing = [where for where, c in calls.items()
               if not any(k.arg in ("input_precision", "allow_tf32") for k in c.keywords)]
    assert not missing, f"tl.dot without input_precision (tf32 on CUDA for fp32 inputs): {missing}"


def test_the_scan_finds_a_dot_without_precision():
    tree = ast.parse("def k(a, b):\n    return tl.dot(a, b)\n")
    assert [c.keywords for c in _dot_calls(tree)] == [[]]
