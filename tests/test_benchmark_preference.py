"""The preference and distillation workloads of `ludic-fast bench` (dpo, orpo, jsd) at tiny shapes: every
implementation computes the float64 reference's loss and gradients, pair batches have an even number of
sequences, the rows each implementation scores, the workloads' own goal verdicts, and the `preference` preset (also with
`--same-rows`: every implementation scoring the same rows)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ludic_fast.benchmark import cli, impls, report
from ludic_fast.benchmark.runner import CaseResult, Options, run_suite
from ludic_fast.benchmark.workloads import WORKLOADS, Shape, make_inputs

TINY = Shape(n=48, d=16, v=257, seq_len=16)  # 3 sequences for the RL workloads, 4 (2 pairs) for dpo / orpo
FAST = Options(threads=1, repeats=1, warmup=0, check_tokens=32, in_process=True)
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_TRL = importlib.util.find_spec("trl") is not None
KEY = Shape(n=2048, d=896, v=151936, seq_len=512)
#: the preference preset at a tiny shape, every case measured once in this process
TINY_PRESET = (
    "--preset preference --device cpu --shapes 48x16x257 --seq-len 16 --one-process --repeats 1 --warmup 0 "
    "--threads 1 --check-tokens 16"
).split()


@pytest.mark.parametrize("workload", ["dpo", "orpo", "jsd"])
def test_every_implementation_matches_the_float64_reference(workload):
    names = ["ours-fused", "ours-generic", "reference"] + ["liger"] * HAS_LIGER + ["trl"] * HAS_TRL
    results = {r.impl: r for r in run_suite(names, [workload], [TINY], FAST, log=lambda _: None)}
    assert not [r for r in results.values() if r.status == "failed"], results
    ran = {name for name, r in results.items() if r.status == "ok"}
    want = {"ours-fused", "reference"} | ({"ours-generic"} if workload != "jsd" else set())
    want |= {"liger"} if HAS_LIGER else set()
    want |= {"trl"} if HAS_TRL and workload in ("jsd", "dpo") else set()
    assert ran == want
    for name in ran:
        e = results[name].errors
        assert e["loss"] < 1e-5 and e["grad_hidden_rel"] < 1e-5 and e["grad_weight_rel"] < 1e-5, (name, e)
        assert e["check_tokens"] == (48 if workload != "jsd" else 32)  # pairs stay whole: 4 sequences of 12
    if workload == "jsd":
        assert "one mode" in results["ours-generic"].reason
    elif HAS_TRL and workload == "orpo":  # TRL's ORPO runs on materialised logits
        assert results["trl"].reason == "no chunked orpo loss"


def test_pair_batches_have_an_even_number_of_sequences():
    dpo, cispo = WORKLOADS["dpo"], WORKLOADS["cispo"]
    assert cispo.layout(TINY) == (3, 16) and dpo.layout(TINY) == (4, 12)
    assert dpo.layout(Shape(n=40, d=4, v=10, seq_len=16)) == (2, 20)  # one sequence would round to B=2
    assert dpo.layout(KEY) == (4, 512)
    inp = make_inputs("dpo", TINY)
    assert inp.hidden.shape == (4, 12, 16) and torch.equal(inp.batch["ref_seq_logps"], torch.zeros(4))
    counts = inp.batch["action_mask"][:, 1:].sum(-1)
    assert (counts == 9).all()  # prompt 3 of 12 tokens: 9 scored per sequence, equal normalisers
    # scored: 4 x 9; Liger scores every position of [B, T-1]; the reference all B*T rows
    rows = {name: impls.IMPLS[name].rows_computed(dpo, TINY) for name in ("ours-fused", "liger", "reference")}
    assert dpo.scored_rows(TINY) == 36 and rows == {"ours-fused": 36, "liger": 44, "reference": 48}
    assert impls._rows(dpo, inp).shape == (36, 16)


def test_same_rows_scores_every_position_after_the_first():
    dpo, cispo = WORKLOADS["dpo"], WORKLOADS["cispo"]
    same = dataclasses.replace(TINY, same_rows=True)
    assert dpo.layout(same) == (4, 12) and same.label() == "N=48 D=16 V=257 float32, same rows"
    mask = make_inputs("dpo", same).batch["action_mask"]
    assert (mask[:, 0] == 0).all() and (mask[:, 1:] == 1).all()
    # ours scores what Liger computes: 4 x 11 (pairs), 3 x 15 (cispo); the reference all B*T rows
    for w, rows in ((dpo, 44), (cispo, 45)):
        got = {name: impls.IMPLS[name].rows_computed(w, same) for name in ("ours-fused", "liger", "trl")}
        assert w.scored_rows(same) == rows and got == {"ours-fused": rows, "liger": rows, "trl": rows}
    assert report.goals_apply(KEY) and not report.goals_apply(dataclasses.replace(KEY, same_rows=True))


def test_distill_inputs_cut_the_teacher_with_the_student():
    inp = make_inputs("jsd", TINY)
    assert inp.hidden.shape == (48, 16) and inp.teacher[0].shape == (48, 16) and inp.teacher[1].shape == (257, 16)
    sub = inp.head_rows(8).fresh()
    assert sub.teacher[0].shape == (8, 16) and sub.teacher[1] is inp.teacher[1]
    assert WORKLOADS["jsd"].scored_rows(TINY) == 48
    with pytest.raises(ValueError, match="pair workload dpo"):
        WORKLOADS["dpo"].layout(Shape(n=3, d=4, v=10, seq_len=3))  # one sequence of 3; a pair: 2 x 1


def _case(impl, role, median, peak, workload):
    return CaseResult(impl, role, workload, KEY, "ok", "", median, median, [median], peak, 2**20, {"loss": 1e-7})


def test_preference_goals_replace_the_rl_goals():
    gib = 2**30
    dpo = [
        _case("ours-fused", "ours", 12.0, 2 * gib, "dpo"),
        _case("liger", "peer", 18.0, 2.5 * gib, "dpo"),
        _case("reference", "reference", 16.0, 6 * gib, "dpo"),
    ]
    ratios = report.ours_table(report.groups(dpo)[(KEY, "dpo")])
    # 12 / 18 = 0.67 > 0.6; peak 2 / 2.5 = 0.8 <= 1.0; no goal against the reference; no stretch line
    assert "| ours-fused | liger | 0.67 | ≤ 0.6: missed by 1.11× | 0.80 | ≤ 1: met |" in ratios
    assert "| ours-fused | reference | 0.75 |  | 0.33 |  |" in ratios and "stretch" not in ratios
    jsd = [dataclasses.replace(r, workload="jsd") for r in dpo[:2]] + [_case("trl", "peer", 24.0, gib, "jsd")]
    ratios = report.ours_table(report.groups(jsd)[(KEY, "jsd")])
    assert "| ours-fused | liger | 0.67 | ≤ 0.6: missed by 1.11× | 0.80 |  |" in ratios
    assert "| ours-fused | trl | 0.50 | ≤ 0.6: met | 2.00 |  |" in ratios


def test_preference_preset_runs_at_a_tiny_shape(tmp_path):
    assert cli.PRESETS["preference"]["shapes"] == [(2048, 896, 151936)]
    assert not set(cli.PRESETS["cpu"]["workloads"]) & {"dpo", "orpo", "jsd"}
    rc = cli.main([*TINY_PRESET, "--impls", "ours-fused,reference", "--out", str(tmp_path)])
    assert rc == 0
    loaded, _ = cli.load_results(tmp_path / "results.json")
    assert [(r.workload, r.impl, r.status) for r in loaded] == [
        (w, i, "ok") for w in ("dpo", "orpo", "jsd") for i in ("ours-fused", "reference")
    ]
    assert "## jsd — N=48 D=16 V=257 float32" in (tmp_path / "results.md").read_text()


def test_preference_preset_same_rows(tmp_path, monkeypatch):
    """`--same-rows` reaches every case (shape, inputs, rows), keeps each implementation on the float64
    reference and writes beside the preset's table, not over it."""
    monkeypatch.chdir(tmp_path)
    names = ["ours-fused", "reference"] + ["liger"] * HAS_LIGER
    rc = cli.main([*TINY_PRESET, "--workloads", "dpo", "--impls", ",".join(names), "--same-rows"])
    assert rc == 0
    out = tmp_path / "bench" / "results" / "preference" / "same-rows"
    loaded, meta = cli.load_results(out / "results.json")
    assert [r.impl for r in loaded] == names and "--same-rows" in meta["command"]
    for r in loaded:
        assert r.status == "ok" and r.shape.same_rows and r.errors["loss"] < 1e-5, r
        assert r.errors["grad_hidden_rel"] < 1e-5 and r.errors["grad_weight_rel"] < 1e-5, r
    text = (out / "results.md").read_text()
    assert "## dpo — N=48 D=16 V=257 float32, same rows" in text and "| ours-fused | 44 |" in text
    assert not (tmp_path / "bench" / "results" / "preference" / "results.json").exists()
