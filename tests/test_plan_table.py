"""bench/plan_table.py --measured: a GPU bench's results beside the cost model's predictions (synthetic
results with hand-set times; the script only assembles the table)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ludic_fast.benchmark.runner import CaseResult
from ludic_fast.benchmark.workloads import Shape
from ludic_fast.ops.plan import plan_head

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "plan_table.py"


def _script():
    spec = importlib.util.spec_from_file_location("plan_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SHAPE = Shape(8192, 4096, 151936, "bfloat16")


def _case(impl: str, workload: str, ms: float | None, status: str = "ok") -> CaseResult:
    role = "peer" if impl == "trl" else "ours"
    return CaseResult(impl, role, workload, SHAPE, status, median_s=None if ms is None else ms / 1e3)


def _cells(table: str, impl: str) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if f"| {impl} |" in ln]
    return [c.strip() for c in line.strip("|").split("|")]


def test_measured_table_rows_ratios_and_predictions(tmp_path, capsys):
    results = [
        _case("ours-fused", "cispo", 30.0),
        _case("ours-fused-tl-dot", "cispo", 60.0),
        _case("trl", "cispo", 40.0),
        _case("ours-generic", "head", 64.0),
        _case("ours-triton-fused", "head", None, status="failed"),  # not ok: no row
        _case("reference", "head", 100.0),  # not one of ours: no row
    ]
    table = _script().measured_table(results, "h100")
    assert len(table.splitlines()) == 2 + 3
    # cispo at N=8192 (16 sequences of 512, prompt 128): 16 x 384 = 6144 scored rows
    cells = _cells(table, "ours-fused")
    plan = plan_head(6144, 4096, 151936, mode="fused_loss", device="h100")
    assert cells[:5] == ["8192 x 4096 x 151936", "cispo", "ours-fused", "6144", plan.strategy]
    assert float(cells[5]) == pytest.approx(plan.predicted_s * 1e3, abs=0.05)
    assert (cells[6], cells[8]) == ("30.0", "0.75")  # 30 / 40 ms
    assert float(cells[7]) == pytest.approx(plan.predicted_s * 1e3 / 30.0, abs=0.005)
    tl_dot = _cells(table, "ours-fused-tl-dot")
    assert tl_dot[4] == "fused" and tl_dot[8] == "1.50"
    head = _cells(table, "ours-generic")
    assert head[3] == "8192" and head[8] == "–"  # no TRL head case in these results

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {}, "results": [r.to_json() for r in results]}))
    _script().main(["--measured", str(path)])
    assert capsys.readouterr().out.strip() == table
