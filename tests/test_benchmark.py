"""Smoke tests of the benchmark runner at tiny shapes: error columns against the float64 reference, the
subprocess path, the tables' ratios and goal verdicts (hand-derived numbers), outputs and the CLI."""

from __future__ import annotations

import importlib.util

import pytest

from ludic_fast.benchmark import cli, report
from ludic_fast.benchmark.runner import CaseResult, Options, run_case, run_suite
from ludic_fast.benchmark.workloads import Shape, make_inputs

TINY = Shape(n=48, d=16, v=257, seq_len=16)
FAST = Options(threads=1, repeats=1, warmup=0, check_tokens=32, in_process=True)
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_TRL = importlib.util.find_spec("trl") is not None


def _impls():
    names = ["ours-generic", "ours-fused", "reference"]
    names += ["liger"] if HAS_LIGER else []
    names += ["trl"] if HAS_TRL else []
    return names


@pytest.mark.parametrize("workload", ["head", "cispo", "grpo", "gspo", "zvp_cispo"])
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
        else:
            assert e["loss"] < 1e-5, (r.impl, e)
        assert r.median_s > 0 and r.min_s <= r.median_s


def test_skips_say_why_and_floors_have_no_errors():
    liger_head = run_case("liger", "head", TINY, FAST)
    fused_head = run_case("ours-fused", "head", TINY, FAST)
    triton = run_case("ours-triton", "head", TINY, FAST)
    assert fused_head.status == "skipped" and "head op" in fused_head.reason
    assert triton.status == "skipped" and "CUDA" in triton.reason
    assert liger_head.status == "skipped" and liger_head.reason
    floor = run_case("gemm-fwd+bwd", "cispo", TINY, FAST)
    assert floor.status == "ok" and floor.errors == {}


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


def _synthetic():
    gib = 2**30
    return [
        _case("ours-fused", "ours", 12.0, 2 * gib),
        _case("reference", "reference", 16.0, 6 * gib),
        _case("liger", "peer", 18.0, 2.5 * gib),
        _case("trl", "peer", 24.0, 2.4 * gib),
        _case("gemm-fwd+bwd", "floor", 10.0, 2.5 * gib),
        CaseResult("verl", "peer", "cispo", TINY, "skipped", "verl not installed"),
    ]


def test_tables_show_every_ratio_and_goal_verdict():
    group = report.groups(_synthetic())[(TINY, "cispo")]
    table = report.results_table(group)
    lines = table.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 15
    ours_row = next(line for line in lines if line.startswith("| ours-fused"))
    # median 12 / reference 16 = 0.75; / GEMMs 10 = 1.20; peak 2 / 6 GiB = 0.33
    assert "| 0.75 | 1.20 | 0.33 |" in ours_row
    assert "Not run: verl (skipped: verl not installed)." in table
    ratios = report.ours_table(group)
    assert "| ours-fused | reference | 0.75 | ≤ 0.75: met | 0.33 | ≤ 0.3: missed by 1.11× |" in ratios
    assert "| ours-fused | liger | 0.67 | ≤ 0.6: missed by 1.11× | 0.80 | ≤ 0.6: missed by 1.33× |" in ratios
    assert "| ours-fused | trl | 0.50 | ≤ 0.5: met |" in ratios
    assert "| ours-fused | gemm-fwd+bwd | 1.20 | ≤ 1: missed by 1.20× |" in ratios
    assert "stretch: inputs + grads + 15%" in ratios


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
    rc = cli.main(["bench", "--workloads", "cispo", "--impls", "ours-fused,verl", "--n", "48", "--d", "16",
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
