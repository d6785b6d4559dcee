"""bench/trainer_profile.py: a tiny CPU run of ours-packed and TRL writes the phase table and one record per run
(phases a path's step has no label for shown as '–'), the host reads named; the phase arithmetic by hand; the
--seconds budget (a run over its share is cut, the runs before it are kept)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _heap import frozen_imports
from _scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench" / "trainer_profile.py"


@pytest.fixture(autouse=True, scope="module")
def _frozen_imports():
    """The script collects the garbage after each in-process run: with the imports frozen that walks only what
    the runs made (tests/_heap.py)."""
    with frozen_imports(peers=False):
        yield


def _bench():
    sys.path.insert(0, str(BENCH.parent))  # the script imports trainer_e2e beside it
    return load_script(BENCH, "trainer_profile")


TINY = ["--vocab", "256", "--hidden", "32", "--layers", "1", "--seqs", "4", "--seq-len", "24", "--steps", "1",
        "--threads", "1"]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl")
def test_tiny_cpu_profile(tmp_path):
    bench = _bench()
    assert bench.main([*TINY, "--paths", "ours-packed,trl", "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert [r["path"] for r in records] == ["ours-packed", "trl"]
    ours, trl = (bench.phase_rows(r) for r in records)
    for phase in ("collation / host", "body forward", "head + loss", "backward", "clip", "host read", "optimizer",
                  "stats / logging"):
        assert ours[phase] > 0, phase
    assert trl["collation / host"] is None and trl["host read"] is None and trl["stats / logging"] is None
    assert trl["body forward"] > 0 and trl["head + loss"] > 0 and trl["optimizer"] > 0
    assert all(r["aten_ops"] > 0 and r["device_events"] is None for r in records)
    assert records[0]["top_level_ops"]["step/collate"] > 0 and "step/collate" not in records[1]["top_level_ops"]
    assert sum(records[0]["top_level_ops"].values()) < records[0]["aten_ops"]  # nested ops are not counted
    engine_reads = [w for w in records[0]["host_reads"]["where"] if "ludic_fast/engine/" in w]
    assert engine_reads == [next(w for w in engine_reads if "read_step_values" in w)]
    assert [r["attention"] for r in records] == ["ludic_sdpa_varlen", "sdpa"]  # packed moved the model (CPU)
    assert [r["compiled_after_warmup"] for r in records] == [0, 0]
    table = (tmp_path / "profile.md").read_text()
    assert "| collation / host | " in table and "| aten ops per step" in table and " – |" in table and "## trl" in table
    assert "| attention implementation | ludic_sdpa_varlen | sdpa |" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.jsonl", "profile.md"]


def test_graphs_compiled_after_the_warm_up_are_counted(monkeypatch):
    """A step that compiles a graph for every new input shape (a stand-in for flex attention meeting a new
    packed length): each timed and profiled step after the warm-up one is counted."""
    import torch

    bench = _bench()
    sizes = iter(range(1, 100))
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    monkeypatch.setattr(bench.trainer_e2e, "build_step",
                        lambda args, path: (lambda: double(torch.ones(next(sizes))), None, torch.nn.Linear(1, 1)))
    args = bench.trainer_e2e.resolve(bench._parser().parse_args([*TINY, "--out", "unused"]))
    record = bench.profile_path(args, "ours-padded")
    assert record["steps"] == 1 and record["compiled_after_warmup"] == 2 and record["attention"] is None


def test_phase_rows_by_hand():
    bench = _bench()
    record = {"profiled_step_s": 0.1, "host_ms": {"step/collate": 5.0, "step/forward_loss": 40.0,
                                                  "step/body_forward": 30.0, "step/backward": 35.0}}
    rows = bench.phase_rows(record)
    assert rows["head + loss"] == 10.0 and rows["body forward"] == 30.0 and rows["clip"] is None
    assert rows["other"] == pytest.approx(100.0 - 5.0 - 40.0 - 35.0)
    assert rows["forward, rest"] is None
    record["host_ms"]["step/head_loss"] = 9.0
    assert bench.phase_rows(record)["head + loss"] == 9.0 and bench.phase_rows(record)["forward, rest"] == 1.0


def test_seconds_budget_cuts_an_isolated_run_and_keeps_the_others(tmp_path, monkeypatch):
    """--isolate, two paths in 10 s: the first (share 5 s) finishes, the second overruns its share and is
    reported cut; the first one's record is in the files."""
    bench = _bench()
    record = {"path": "ours-packed", "steps": 1, "step_s": 0.5, "profiled_step_s": 0.6, "tokens": 8,
              "host_ms": {"step/backward": 1.0}, "device_ms": {}, "device_busy_ms": None, "top": {},
              "host_reads": {"kind": "host read (CPU)", "count": 1, "where": {"x": 1}}}
    shares = []

    def run(cmd, timeout, **kw):
        shares.append(timeout)
        if "ours-padded" in cmd:
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, 0, bench.RESULT_PREFIX + json.dumps(record) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    argv = ["--paths", "ours-packed,ours-padded", "--seconds", "10", "--isolate", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    saved = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert saved[0]["step_s"] == 0.5 and saved[1]["skipped"].startswith("cut by --seconds")
    assert shares[0] == pytest.approx(5.0, abs=0.5) and shares[1] <= 10.0
    assert "ours-padded: cut by --seconds" in (tmp_path / "profile.md").read_text()


def test_seconds_budget_stops_a_run_in_process(tmp_path, monkeypatch):
    """In this process, a run over its share is stopped by the alarm; a failing run is reported as failed; the
    run after both still runs. 8 s for three runs: the first's share is max(8 - 2 x 12, 8 / 3) = 2.7 s, which
    leaves the next run (5.3 - overhead) / 2 s of share: over the 1 s a run needs even with 3 s of overhead on
    a loaded machine."""
    import time

    bench = _bench()
    calls = []

    def profile_path(args, path, deadline=None):
        calls.append(path)
        if path == "ours-packed":
            time.sleep(60)
        if path == "reference":
            raise ValueError("boom")
        return {"path": path, "steps": 1, "step_s": 0.5, "profiled_step_s": 0.6, "tokens": 8, "host_ms": {},
                "device_ms": {}, "device_busy_ms": None, "top": {},
                "host_reads": {"kind": "host read (CPU)", "count": 0, "where": {}}}

    monkeypatch.setattr(bench, "profile_path", profile_path)
    t0 = time.monotonic()
    argv = ["--paths", "ours-packed,reference,ours-padded", "--seconds", "8", "--out", str(tmp_path)]
    assert bench.main(argv) == 1
    assert time.monotonic() - t0 < 40  # the 60 s sleep did not run out
    saved = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert saved[0]["skipped"] == "cut by --seconds after 3 s"
    assert saved[1]["skipped"] == "failed: ValueError: boom" and saved[1]["failed"]
    assert saved[2]["step_s"] == 0.5 and calls == ["ours-packed", "reference", "ours-padded"]


def test_a_run_may_use_the_time_left_less_a_reserve_for_the_runs_after_it(tmp_path, monkeypatch):
    """60 s for three quick runs: the first may use 60 - 2 x 12 = 36 s, the second 60 - 12 = 48 s (the first
    left its time unused), the last all 60 s."""
    bench = _bench()
    record = {"path": "ours-packed", "steps": 1, "step_s": 0.5, "profiled_step_s": 0.6, "tokens": 8,
              "host_ms": {}, "device_ms": {}, "device_busy_ms": None, "top": {},
              "host_reads": {"kind": "host read (CPU)", "count": 0, "where": {}}}
    shares = []

    def run(cmd, timeout, **kw):
        shares.append(timeout)
        return subprocess.CompletedProcess(cmd, 0, bench.RESULT_PREFIX + json.dumps(record) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(bench.time, "monotonic", lambda: 0.0)  # the runs take no time
    argv = ["--paths", "ours-packed,ours-padded,reference", "--seconds", "60", "--isolate", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    assert shares == [36.0, 48.0, 60.0]
