"""Smoke tests of the benchmark runner at tiny shapes: error columns against the float64 reference, the
subprocess and one-process paths, failures recorded as results, the tables' rows / µs-per-row / ratios and
goal verdicts (hand-derived numbers, goals only at their stated shape), plot colours, outputs and the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
from _heap import frozen_imports

from ludic_fast.benchmark import cli, impls, report
from ludic_fast.benchmark.runner import CaseResult, Options, run_case, run_suite
from ludic_fast.benchmark.workloads import WORKLOADS, Shape, make_inputs

TINY = Shape(n=48, d=16, v=257, seq_len=16)
FAST = Options(threads=1, repeats=1, warmup=0, check_tokens=32, in_process=True)
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(autouse=True, scope="module")
def _frozen_imports():
    with frozen_imports():
        yield


def _impls():
    names = ["ours-generic", "ours-fused", "reference", "torch-lce"]
    names += ["liger"] if HAS_LIGER else []
    names += ["trl"] if HAS_TRL else []
    return names


@pytest.mark.parametrize("workload", ["head", "sft", "cispo", "grpo", "gspo", "zvp_cispo"])
def test_error_columns_are_small_for_every_implementation(workload):
    results = run_suite(_impls(), [workload], [TINY], FAST, log=lambda _: None)
    ran = [r for r in results if r.status == "ok"]
    assert {r.impl for r in ran} >= {"ours-generic", "reference"}
    assert not [r for r in results if r.status == "failed"]
    for r in ran:
        e = r.errors
        assert e["check_tokens"] == 32
        assert e["grad_hidden_rel"] < 1e-5 and e["grad_weight_rel"] < 1e-5, (r.impl, e)
        if workload == "head":
            assert e["logprobs"] < 1e-5 and e["entropy"] < 1e-5, (r.impl, e)
        elif workload == "sft":
            assert e["loss"] < 1e-5 and "logprobs" not in e, (r.impl, e)
        else:
            assert e["loss"] < 1e-5, (r.impl, e)
        assert r.median_s > 0 and r.min_s <= r.median_s


def test_skips_say_why_and_floors_have_no_errors():
    liger_head = run_case("liger", "head", TINY, FAST)
    fused_head = run_case("ours-fused", "head", TINY, FAST)
    assert fused_head.status == "skipped" and "ours-generic" in fused_head.reason
    workload = {"cce": "sft", "ours-fused-tl-dot": "cispo", "ours-fused-workspace": "cispo"}
    for name in ("ours-triton-fused", "ours-triton-workspace", "ours-fused-tl-dot", "ours-fused-workspace", "cce",
                 "ours-generic-held"):
        r = run_case(name, workload.get(name, "head"), TINY, FAST)
        assert r.status == "skipped" and "CUDA" in r.reason, name
    assert "backend auto is torch" in run_case("ours-torch", "cispo", TINY, FAST).reason
    lce = run_case("torch-lce", "cispo", TINY, FAST)  # torch < 2.13 has no linear_cross_entropy: says so first
    lce_missing = impls.IMPLS["torch-lce"].available()
    assert lce.status == "skipped" and lce.reason == (lce_missing or "cross-entropy only")
    assert liger_head.status == "skipped" and liger_head.reason
    floor = run_case("gemm-fwd+bwd", "cispo", TINY, FAST)
    assert floor.status == "ok" and floor.errors == {}


def test_rows_scored_and_computed():
    """TINY: 3 sequences of 16 tokens, prompt 4: 3 x 12 action rows; Liger scores 3 x 15, the reference 48."""
    cispo, head = WORKLOADS["cispo"], WORKLOADS["head"]
    assert cispo.scored_rows(TINY) == 36 and head.scored_rows(TINY) == 48
    inp = make_inputs("cispo", TINY)
    assert int(inp.batch["action_mask"][:, 1:].sum()) == 36
    rows = {name: impls.IMPLS[name].rows_computed(cispo, TINY) for name in ("ours-fused", "trl", "liger", "reference")}
    assert rows == {"ours-fused": 36, "trl": 36, "liger": 45, "reference": 48}
    assert impls.IMPLS["liger"].rows_computed(head, TINY) == 48


def test_floor_gemms_cover_the_scored_rows():
    inp = make_inputs("cispo", TINY)
    assert impls._rows(WORKLOADS["cispo"], inp).shape == (36, TINY.d)
    assert impls._rows(WORKLOADS["sft"], make_inputs("sft", TINY)).shape == (48, TINY.d)


def test_one_process_records_failures_and_forced_strategy_is_restored(monkeypatch):
    def build(workload, inp):
        def step():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return step

    broken = dataclasses.replace(impls.IMPLS["ours-generic"], name="broken", build=build)
    monkeypatch.setitem(impls.IMPLS, "broken", broken)
    r = run_case("broken", "head", TINY, FAST)
    assert r.status == "failed" and r.reason.startswith("OutOfMemoryError: CUDA out of memory"), r.reason
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", "auto")
    with impls._strategy("workspace"):
        assert os.environ["LUDIC_FAST_TRITON_STRATEGY"] == "workspace"
    assert os.environ["LUDIC_FAST_TRITON_STRATEGY"] == "auto"


def test_inputs_are_deterministic_and_peer_normalisers_match_ludic():
    a, b = make_inputs("cispo", TINY, seed=3), make_inputs("cispo", TINY, seed=3)
    assert (a.hidden == b.hidden).all() and (a.batch["actor_logps"] == b.batch["actor_logps"]).all()
    counts = a.batch["action_mask"][:, 1:].sum(-1)
    assert (counts == counts[0]).all() and counts[0] > 0  # equal action tokens: token mean == sequence mean


def test_shape_validation_names_the_field():
    with pytest.raises(ValueError, match="Shape.d"):
        Shape(n=8, d=0, v=10)
    with pytest.raises(ValueError, match="dtype"):
        Shape(n=8, d=4, v=10, dtype="int8")
    assert Shape(n=1937, d=8, v=10, seq_len=512).n_tokens == 1936  # 4 sequences of 484


def _case(impl, role, median, peak, base=100 * 2**20, workload="cispo", status="ok", reason=""):
    return CaseResult(impl, role, workload, TINY, status, reason, median, median, [median], peak, base,
                      {"loss": 1e-7, "grad_hidden_rel": 2e-7, "grad_weight_rel": 3e-7})


def _synthetic(shape=TINY):
    gib = 2**30
    return [dataclasses.replace(r, shape=shape) for r in (
        _case("ours-fused", "ours", 12.0, 2 * gib),
        _case("reference", "reference", 16.0, 6 * gib),
        _case("liger", "peer", 18.0, 2.5 * gib),
        _case("trl", "peer", 24.0, 2.4 * gib),
        _case("gemm-fwd+bwd", "floor", 10.0, 2.5 * gib),
        CaseResult("verl", "peer", "cispo", TINY, "skipped", "verl not installed"),
    )]


KEY = Shape(n=2048, d=896, v=151936, seq_len=512)  # the shape the goals are stated for


def test_tables_show_every_ratio_and_goal_verdict():
    group = report.groups(_synthetic(KEY))[(KEY, "cispo")]
    table = report.results_table(group)
    lines = table.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 18
    ours_row = next(line for line in lines if line.startswith("| ours-fused"))
    # 4 sequences of 512, 384 action rows each: 1536 rows; 12 s / 1536 = 7812.5 µs per row
    # median 12 / reference 16 = 0.75; / GEMMs 10 = 1.20; peak 2 / 6 GiB = 0.33; extra 2 GiB - 100 MiB
    assert ours_row.startswith("| ours-fused | 1536 | 12.000 | 12.000 | 7.81e+03 |")
    assert "| 1.90 |" in ours_row and "| 0.75 | 1.20 | 0.33 |" in ours_row
    assert next(line for line in lines if line.startswith("| reference")).startswith("| reference | 2048 |")
    assert "Not run: verl (skipped: verl not installed)." in table
    ratios = report.ours_table(group)
    assert "| ours-fused | reference | 0.75 | ≤ 0.75: met | 0.33 | ≤ 0.3: missed by 1.11× |" in ratios
    assert "| ours-fused | liger | 0.67 | ≤ 0.6: missed by 1.11× | 0.80 | ≤ 0.6: missed by 1.33× |" in ratios
    assert "| ours-fused | trl | 0.50 | ≤ 0.5: met |" in ratios
    assert "| ours-fused | gemm-fwd+bwd | 1.20 | ≤ 1: missed by 1.20× |" in ratios
    assert "stretch: inputs + grads + 15%" in ratios


def test_goal_verdicts_only_at_the_shape_they_are_stated_for():
    ratios = report.ours_table(report.groups(_synthetic())[(TINY, "cispo")])
    assert "| ours-fused | reference | 0.75 |  | 0.33 |  |" in ratios
    assert "missed" not in ratios and "met" not in ratios and "stretch" not in ratios


def test_each_implementation_has_one_colour_everywhere():
    colours = {name: report.colour(name) for name in impls.IMPLS}
    assert len(set(colours.values())) == len(colours)  # distinct
    assert report.colour("liger") == colours["liger"] and report.colour("old-name") == report.colour("other")


def test_outputs_round_trip_and_plot(tmp_path):
    results = _synthetic() + [
        CaseResult(r.impl, r.role, r.workload, Shape(n=96, d=16, v=257, seq_len=16), r.status, r.reason,
                   r.median_s and 2 * r.median_s, r.min_s, r.times_s, r.peak_bytes, r.base_bytes, r.errors)
        for r in _synthetic()
    ]
    cli.write_outputs(results, {"command": "test"}, tmp_path)
    loaded, meta = cli.load_results(tmp_path / "results.json")
    assert meta == {"command": "test"} and loaded == results
    text = (tmp_path / "results.md").read_text()
    assert cli.main(["--render", str(tmp_path / "results.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "results.md").read_text() == text
    assert "## cispo — N=48 D=16 V=257 float32" in text and "## cispo — N=96 D=16 V=257 float32" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "scaling_cispo_n.png").stat().st_size > 0
        assert not (tmp_path / "scaling_cispo_v.png").exists()  # V does not vary


def test_cli_runs_each_case_in_a_subprocess(tmp_path):
    rc = cli.main(["bench", "--device", "cpu", "--workloads", "cispo", "--impls", "ours-fused,verl", "--n", "48",
                   "--d", "16",
                   "--v", "257", "--seq-len", "16", "--repeats", "2", "--threads", "1", "--check-tokens", "16",
                   "--out", str(tmp_path)])
    assert rc == 0
    loaded, meta = cli.load_results(tmp_path / "results.json")
    ours, verl = loaded
    assert ours.impl == "ours-fused" and ours.status == "ok", ours.reason
    assert len(ours.times_s) == 2 and ours.min_s == min(ours.times_s)
    assert ours.peak_bytes >= ours.base_bytes > 0
    assert ours.errors["loss"] < 1e-5 and ours.errors["check_tokens"] == 16
    assert verl.impl == "verl" and verl.status in ("ok", "skipped")
    assert "load average after" in meta and (tmp_path / "results.md").exists()
    with pytest.raises(SystemExit):
        cli.main(["--workloads", "nope", "--out", str(tmp_path)])


def test_cli_one_process_with_explicit_shapes(tmp_path, capsys):
    rc = cli.main(["--device", "cpu", "--workloads", "sft", "--impls", "ours-generic,reference,ours-torch",
                   "--shapes", "48x16x257", "--one-process", "--repeats", "1", "--warmup", "0", "--threads", "1",
                   "--check-tokens", "16", "--out", str(tmp_path)])
    assert rc == 0
    loaded, meta = cli.load_results(tmp_path / "results.json")
    assert [(r.impl, r.status) for r in loaded] == [("ours-generic", "ok"), ("reference", "ok"),
                                                    ("ours-torch", "skipped")]
    assert loaded[0].shape.label() == "N=48 D=16 V=257 float32" and loaded[0].errors["loss"] < 1e-5
    assert "every case in one process" in meta["runs"] and "torch" in meta["versions"]
    printed = capsys.readouterr().out
    assert "| sft | N=48 D=16 V=257 float32 | ours-generic |" in printed  # the summary table comes last
    with pytest.raises(SystemExit):
        cli.main(["--shapes", "48x16", "--out", str(tmp_path)])


def test_a_run_stopped_midway_keeps_the_cases_it_measured(tmp_path, monkeypatch):
    """The third case is interrupted (as a kill or a time limit would): results.json and results.md already
    hold the first two, marked incomplete; a finished run drops the mark."""
    from ludic_fast.benchmark import runner

    real, calls = runner.run_case, []

    def interrupted_third(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_case", interrupted_third)
    argv = ["--device", "cpu", "--workloads", "sft", "--impls", "ours-generic,reference,gemm-fwd",
            "--shapes", "48x16x257", "--one-process", "--repeats", "1", "--warmup", "0", "--threads", "1",
            "--check-tokens", "16", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)
    loaded, meta = cli.load_results(tmp_path / "results.json")
    assert [(r.impl, r.status) for r in loaded] == [("ours-generic", "ok"), ("reference", "ok")]
    assert meta["status"] == "incomplete: 2 of 3 cases (the run stopped)"
    assert "incomplete: 2 of 3" in (tmp_path / "results.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))
    monkeypatch.setattr(runner, "run_case", real)
    assert cli.main(argv) == 0
    loaded, meta = cli.load_results(tmp_path / "results.json")
    assert len(loaded) == 3 and "status" not in meta


def test_summary_table_separates_the_gradients_from_the_transient_memory():
    """bf16 N=8192 D=4096 V=151936: the inputs' gradients are 2 (8192 + 151936) 4096 bytes = 1.2207 GiB, so a
    case 2.0 GiB above its inputs has 0.78 GiB of transient memory; a failed case shows its reason."""
    shape = Shape(8192, 4096, 151936, "bfloat16")
    gib = 2**30
    ok = CaseResult("trl", "peer", "head", shape, "ok", median_s=0.0627, peak_bytes=5 * gib, base_bytes=3 * gib)
    oom = CaseResult("reference", "reference", "head", shape, "failed", reason="out of memory")
    lines = report.summary_table([ok, oom]).splitlines()
    assert lines[0].split("|")[6:8] == [" extra GiB ", " transient GiB "]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[2:] == ["trl", "62.70", "7.65", "2.00", "0.78", "ok"]
    assert lines[3].endswith("| – | – | failed: out of memory |")
