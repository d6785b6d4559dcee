"""bench/preference_bench.py at a tiny shape: every implementation of every workload runs and computes the same
loss and gradient norms as ours (so the timed rows compare equal work), and the table has a row for each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "preference_bench.py"


def test_tiny_run_agrees_with_ours(tmp_path):
    pytest.importorskip("liger_kernel")
    pytest.importorskip("trl")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--n", "64", "--d", "16", "--v", "101", "--seq", "16", "--teacher-dim", "24",
           "--threads", "1", "--repeats", "1", "--inprocess", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())
    assert {(r["workload"], r["impl"]) for r in rows} == {
        ("dpo", i) for i in ("ours", "ours_pair", "liger", "reference")} | {
        ("orpo", i) for i in ("ours", "ours_pair", "liger", "reference")} | {
        ("jsd", i) for i in ("ours", "liger", "trl", "reference")}
    ours = {r["workload"]: r for r in rows if r["impl"] == "ours"}
    for r in rows:
        o = ours[r["workload"]]
        assert abs(r["loss"] - o["loss"]) <= 1e-4 * abs(o["loss"]), r
        for a, b in zip(r["grad_norms"], o["grad_norms"]):
            assert abs(a - b) <= 1e-4 * b, r
    table = out.with_suffix(".md").read_text()
    assert table.count("\n| ") == len(rows) + 1  # header row + one row per measurement
