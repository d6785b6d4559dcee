"""The GPU tooling's CPU-checkable parts: bench/gpu_session.sh (argument checks; the first call rehearsed on
the CPU with a failing and a hanging test and a hanging bench case injected), bench/gpu_plan.py (the calls'
stages, seconds and orderings), the bench's inputs built once per shape and its in-process case time limit,
`make test-gpu` (never installs torch, installs with --no-index; stops with a message naming CUDA when there is
none) and tools/gpu_requirements.py (never names torch or triton)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from _heap import frozen_imports
from _machine import slowdown

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_session.sh"


def _bash(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=2000,
                          env={**os.environ, **env})


def test_session_script_checks_its_arguments_before_any_work(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    for args in (("run5",), ("rehearse", "run9"), ("run1", "run2"), ()):
        out = _bash(*args, RESULTS=str(tmp_path / "r"))
        assert out.returncode == 2 and not (tmp_path / "r").exists(), (args, out.stderr)
    assert "rehearse" in _bash().stdout


def test_session_plan_fits_the_calls_and_orders_the_stages():
    """Each call's stages fit its seconds; run1 + run2 fit one 15-minute GPU loan with the machine's start
    (~160 s); in priority order: the whole core suite's verdict and the decisive numbers in the first call,
    the trainer race and profile in the second, the rest (DPO and distillation against Liger, the forced
    strategies at D=896, TMA) in a third, the memory race in a fourth; the goals' implementations first in their
    bench stages; each stage's estimate within its seconds (the suite's within its own --seconds, the stage's
    less 10; find-max's first rows and margin within the stage, leaving its search most of it)."""
    plan = _plan()
    for call, limit in (("run1", 480), ("run2", 230), ("run3", 300), ("run4", 360)):
        seconds, stages = plan.CALLS[call]
        assert seconds == limit and sum(s for _, s in stages) <= limit
    assert plan.CALLS["run1"][0] + plan.CALLS["run2"][0] + 160 <= 900
    assert [s for s, _ in plan.CALLS["run1"][1]] == ["setup", "suite", "decisive"]
    assert [s for s, _ in plan.CALLS["run2"][1]] == ["setup", "e2e", "profile"]
    assert [s for s, _ in plan.CALLS["run3"][1]] == ["setup", "preference", "shapes", "experimental"]
    assert [s for s, _ in plan.CALLS["run4"][1]] == ["setup", "find-max"]
    given = {s: g for _, stages in plan.CALLS.values() for s, g in stages}
    for stage in plan.BENCH_STAGES:
        assert plan.stage_estimate(stage)[0] <= given[stage]
    assert plan.BENCH_STAGES["decisive"][2] == ("ours-generic", "ours-fused", "trl", "gemm-fwd+bwd",
                                                "ours-generic-held")
    assert plan.LEFTOVER_IMPLS == {"decisive": ("ours-generic-held",)}  # after the rest, not in its seconds
    assert plan.BENCH_STAGES["preference"][1:] == (("dpo", "jsd"), ("ours-fused", "liger", "gemm-fwd+bwd"))
    assert plan.BENCH_STAGES["shapes"][2][:2] == ("ours-fused", "trl")
    assert plan.suite_tests() * plan.SUITE_TEST_S <= given["suite"] - 10
    assert len(plan.E2E_PATHS) * plan.E2E_PATH_S <= given["e2e"] - 10
    assert plan.find_max_seconds(given["find-max"]) >= 2 * len(plan.E2E_PATHS) * plan.E2E_PATH_S  # 2 tries a path
    assert set(plan.BENCH_STAGES["decisive"][0]) == {"anchor", "qwen0.5b"}  # the goals' two shapes
    assert all("tma" in impl for impl in plan.BENCH_STAGES["experimental"][2])
    args = plan.bench_args("decisive", "trl", tiny=False)
    assert args[:6] == ["--preset", "gpu", "--shapes", "8192x4096x151936,16384x896x151936", "--workloads",
                        "head,cispo"]


def test_the_whole_core_suite_as_collected_fits_run1():
    """What pytest collects of the GPU suite now, less the TMA tests and the duplicates, fits the suite's own
    --seconds at the measured seconds a test (a GPU test added beyond that needs a new plan); the plan's
    duplicates count is what the pattern leaves out; the prior run's jsonl the suite orders by exists."""
    plan, suite = _plan(), _suite_module()
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu or interpret", *suite.TESTS], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    tma = [i for i in ids if "tma" in i.split("::")[-1].lower()]
    dropped = [i for i in ids if any(re.search(p, i) for p, _ in suite.DUPLICATES)]
    assert (len(ids), len(tma), len(dropped)) == (plan.SUITE_TESTS, plan.SUITE_TMA_TESTS, plan.SUITE_DUPLICATES)
    core = len(ids) - len(tma) - len(dropped)
    assert core * plan.SUITE_TEST_S <= dict(plan.CALLS["run1"][1])["suite"] - 10, core
    assert plan.SUITE_PRIOR and all((ROOT / path).is_file() for path in plan.SUITE_PRIOR)


def test_the_budget_table_in_the_docs_is_the_plans():
    assert _plan().budget_table() in (ROOT / "docs" / "kernels.md").read_text()


def _plan():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_plan
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_plan


INJECTED_TESTS = """
import time

import pytest


@pytest.mark.gpu
def test_injected_failure():
    assert 1 == 2, "injected"


@pytest.mark.gpu
def test_injected_hang():
    time.sleep(10**6)


@pytest.mark.gpu
def test_injected_after_the_hang():
    pass


@pytest.mark.gpu
def test_injected_tma_variant():
    pass
"""
#: a TRL whose head never returns (shadows the installed one through PYTHONPATH)
HANGING_TRL = """
import time


class ChunkedLogProbFunction:
    @staticmethod
    def apply(*args):
        time.sleep(10**6)
"""


@pytest.mark.slow
def test_rehearsal_keeps_every_table_when_a_test_fails_and_a_case_hangs(tmp_path):
    """The first call rehearsed on the CPU with a failing and a hanging test injected into the suite and a
    hanging TRL: the suite's verdict names both, the failure with its message, and the tests after the hang
    ran; the TMA variant is not in the core group; TRL's hang ends its process at CASE_SECONDS, the floor is
    measured after it; every table, log and the tarball are there, at most 8 files in the call's out folder;
    the exit status says not all went well."""
    fake = tmp_path / "fake"
    (fake / "trl" / "kernels").mkdir(parents=True)
    (fake / "trl" / "__init__.py").write_text("")
    (fake / "trl" / "kernels" / "__init__.py").write_text(HANGING_TRL)
    (tmp_path / "test_injected.py").write_text(INJECTED_TESTS)
    res = tmp_path / "results"
    # each stage's seconds x 4 x slow, the hang limits x slow: every process starts slowly here. Each hang
    # costs its whole limit, so the limits are a few times what a test (trivial here) or a bench case (~1 s at
    # these shapes on a quiet machine) takes
    slow = slowdown()
    out = _bash("rehearse", "run1", PY=sys.executable, RESULTS=str(res), PYTHONPATH=str(fake),
                TEST_SECONDS=str(2 * slow), CASE_SECONDS=str(3 * slow),
                GPU_SUITE_TESTS=str(tmp_path / "test_injected.py"), OMP_NUM_THREADS="1", TIME_SCALE=str(4 * slow))
    assert out.returncode == 1, out.stderr[-3000:]
    core = (res / "suite-core-verdict.md").read_text()
    shards = [line.split("|")[1:-1] for line in core.splitlines() if line.startswith("| core.")]
    assert len(shards) == 3 and all(cells[-1].strip() == "ran to its end" for cells in shards), core  # 3 shards
    totals = [sum(int(cells[k]) for cells in shards) for k in range(1, 8)]
    assert "NOT green" in core and totals == [1, 1, 0, 1, 0, 0, 0], core  # passed, failed, skipped, hung, ...
    assert "test_injected_failure" in core and f"over {2 * slow} s): `" in core
    assert "test_injected_hang`" in core
    assert "AssertionError: injected" in core and "test_injected_tma_variant" not in core
    assert f"Timeout ({timedelta(seconds=3 * slow)})" in (res / "decisive-trl.log").read_text()
    table = (res / "decisive" / "results.md").read_text()
    assert "| ours-generic |" in table and "| gemm-fwd+bwd |" in table and "trl: no result (its log)" in table
    log = (res / "session-run1.log").read_text()
    order = [log.index(f"stage {s}:") for s in ("setup", "suite", "decisive")]
    assert order == sorted(order) and "decisive-trl: exit status 1" in log
    # the call's last stage gets what the suite left: more than its own seconds, for its leftover implementation
    decisive = int(re.search(r"stage decisive: (\d+)s given", log).group(1))
    assert decisive > dict(_plan().CALLS["run1"][1])["decisive"] * 4 * slow, log
    assert "ours-generic-held: complete" in (res / "decisive" / "results.md").read_text()
    files = {p.name for p in (res / "out-run1").iterdir()}
    assert len(files) <= 8 and {"session-run1.log", "results-run1.tar.gz", "suite-core-verdict.md",
                                "decisive-results.md"} <= files, files


def test_an_in_process_case_over_its_timeout_ends_the_process():
    """One process measures every GPU case: a case over --timeout ends it (stacks on stderr) after the
    cases before it were saved. (The peers' imports, which the runner makes before a case's timer starts, are
    left out: no case here measures a peer.)"""
    code = """if True:
        import dataclasses, gc, time
        from ludic_fast.benchmark import impls, runner, worker
        from ludic_fast.benchmark.workloads import Shape

        def hang(workload, inp):
            time.sleep(10**6)

        runner.preload = worker.preload = lambda: None
        gc.freeze()  # the imports out of the collection after each case (tests/_heap.py)
        impls.IMPLS["reference"] = dataclasses.replace(impls.IMPLS["reference"], build=hang)
        opts = runner.Options(repeats=1, warmup=0, check_tokens=0, in_process=True, timeout_s=2)
        runner.run_suite(["gemm-fwd+bwd", "reference"], ["head"], [Shape(32, 8, 64)], opts, log=print,
                         on_result=lambda done: print("saved", len(done), flush=True))
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1 and "saved 1" in run.stdout and "saved 2" not in run.stdout
    assert "Timeout (0:00:02)" in run.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_gpu_keeps_the_machine_torch_and_needs_cuda():
    plan = subprocess.run(["make", "-n", "test-gpu"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "--no-index" in plan and "--no-deps" in plan and "torch==" not in plan
    assert "bench/gpu_suite.py" in plan and "--preset gpu-key" in plan
    import torch

    if not torch.cuda.is_available():
        run = subprocess.run(["make", "test-gpu", f"GPU_PY={sys.executable}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr


def test_gpu_requirements_never_name_torch_or_triton(monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_requirements
    finally:
        sys.path.remove(str(ROOT / "tools"))
    reqs = ["torch>=99", "triton>=99; platform_system == 'Linux'", "transformers>=99", "numpy", "vllm; extra == 'vllm'"]
    installed = {"numpy": "2.0", "transformers": "5.0", "torch": "2.0", "pytest": "8.0"}

    def version(name):
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(gpu_requirements.md, "requires", lambda dist: reqs)
    monkeypatch.setattr(gpu_requirements.md, "version", version)
    assert gpu_requirements.missing() == ["transformers>=99"]
    del installed["pytest"]
    assert gpu_requirements.missing() == ["transformers>=99", "pytest"]


def test_bench_builds_inputs_once_per_shape_and_workload(monkeypatch):
    """In one process (the GPU presets) the cases of a shape share inputs built once per workload, on the
    case's device; the next shape frees them first."""
    with frozen_imports():
        _bench_builds_inputs_once(monkeypatch)


def _bench_builds_inputs_once(monkeypatch):
    from ludic_fast.benchmark import worker
    from ludic_fast.benchmark.runner import Options, run_suite
    from ludic_fast.benchmark.workloads import Shape

    built = []
    make = worker.make_inputs
    monkeypatch.setattr(worker, "make_inputs", lambda *a, **kw: built.append((a[0], a[1].n)) or make(*a, **kw))
    monkeypatch.setattr(worker, "_SHAPE_INPUTS", {})
    shapes = [Shape(48, 16, 101, seq_len=24), Shape(64, 16, 101, seq_len=32)]
    opts = Options(repeats=1, warmup=0, check_tokens=8, in_process=True)
    impls = ["ours-generic", "ours-fused", "reference", "gemm-fwd+bwd"]
    results = run_suite(impls, ["head", "cispo"], shapes, opts, log=lambda _: None)
    assert [r.status for r in results].count("ok") == 14  # ours-fused skips the head op (ours-generic is it)
    assert built == [("head", 48), ("cispo", 48), ("head", 64), ("cispo", 64)]
    assert {k[1].n for k in worker._SHAPE_INPUTS} == {64}
    assert all(t.device.type == "cpu" for inp in worker._SHAPE_INPUTS.values() for t in inp.leaves())


GROUPED_TESTS = """
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1])
def test_plain(n):
    pass


test_plain.tmax_seen = True  # a function attribute: pytest -k matches it as a keyword, as 9.1 did "pytestmark"


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fused-tma"])
def test_variant(route):
    pass
"""


@pytest.mark.parametrize("group,kept", [("core", "test_plain[1]"), ("experimental", "test_variant[fused-tma]")])
def test_suite_groups_by_the_tests_name_and_id(tmp_path, group, kept):
    """A test goes to the TMA group when "tma" is in its name or parameter id, whatever else pytest's -k
    would match (its marks, its attributes): on the GPU image's pytest 9.1 `-k "not tma"` left 17 of 491."""
    (tmp_path / "test_grouped.py").write_text(GROUPED_TESTS)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--out", str(tmp_path),
                          "--group", group, "--seconds", "120", "--tests", str(tmp_path / "test_grouped.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    log = (tmp_path / f"suite-{group}.log").read_text()
    assert f"::{kept} PASSED" in log and "1 passed" in log, log[-2000:]


CUT_TESTS = """
import time

import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(3))
def test_quick(i):
    pass


@pytest.mark.gpu
def test_planted_failure():
    two = 2
    assert two == 3, "planted: two is not three"


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(40))
def test_slow(i):
    time.sleep(SLEEP)
"""


def _suite_cmd(tmp_path, *args, sleep: float) -> list[str]:
    """The suite on CUT_TESTS, its test_slow tests sleeping `sleep` s each."""
    (tmp_path / "test_cut.py").write_text(CUT_TESTS.replace("SLEEP", str(sleep)))
    return [sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--out", str(tmp_path / "out"), "--group", "core",
            "--test-seconds", "60", "--tests", str(tmp_path / "test_cut.py"), "--verdict-copy", str(tmp_path / "copy"),
            *args]


def _verdict(tmp_path) -> tuple[str, list[str]]:
    """The suite's verdict and the tests it lists as run."""
    verdict = (tmp_path / "out" / "suite-core-verdict.md").read_text()
    return verdict, [line for line in verdict.splitlines() if line.startswith(("- passed ", "- failed "))]


def _finished(tmp_path, jsonl: str = "suite-core.jsonl") -> list[str]:
    """The tests the suite's jsonl files (`jsonl`, a glob: "suite-core.*.jsonl" for the shards') have as
    finished, in order within each file."""
    rows = []
    for path in sorted((tmp_path / "out").glob(jsonl)):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return [r["finish"] for r in rows if "finish" in r]


def _cut_by_outer_timeout(tmp_path, cmd: list[str], finished: int, jsonl: str) -> tuple[int, str, str]:
    """Run the suite `cmd` under `timeout` as bench/gpu_session.sh runs a stage, and cut it once `finished`
    tests finished (`_finished(tmp_path, jsonl)`), by SIGALRM to `timeout`, the signal of its own expiry (GNU
    timeout: exit 124, SIGTERM to the child and its group): no wall-clock guess of the machine's speed sets
    when the cut lands. (returncode, stdout, stderr)."""
    proc = subprocess.Popen(["timeout", "--kill-after=5", "300", *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while len(_finished(tmp_path, jsonl)) < finished and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGALRM)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout not installed")
def test_verdict_survives_the_stages_outer_limit(tmp_path):
    """The suite's own --seconds is far off; the outer `timeout` (SIGTERM to the process group) cuts it
    mid-suite. The verdict written then (also in the --verdict-copy folder) names the planted failure with its
    message and traceback line, lists every test that finished (as the jsonl has them) and the tests that
    never ran, and says it was cut. The cut comes once 5 tests finished (the 4 quick ones and a slow one)."""
    cmd = _suite_cmd(tmp_path, "--seconds", "600", sleep=0.5)
    returncode, out, err = _cut_by_outer_timeout(tmp_path, cmd, 5, "suite-core.jsonl")
    verdict, ran = _verdict(tmp_path)
    assert returncode == 124, out[-2000:] + err[-2000:]
    assert verdict.startswith("# GPU suite verdict: NOT green") and "cut: SIGTERM" in verdict, verdict
    assert "### failed (core, call): `" in verdict and "AssertionError: planted: two is not three" in verdict
    assert "assert two == 3" in verdict  # the traceback's lines
    finished = _finished(tmp_path)
    assert 5 <= len(finished) < 43 and len(ran) == len(finished)  # cut mid-suite, every finished test listed
    assert all(f"`{n}`" in line for n, line in zip(finished, ran))
    assert f"| core | {len(finished) - 1} | 1 | 0 | 0 |" in verdict and "Not run (core, " in verdict
    assert "test_slow[39]`" in verdict.split("Not run (core, ")[1]
    assert (tmp_path / "copy" / "suite-core-verdict.md").read_text() == verdict  # as a call's $OUT gets it


def test_suite_stops_starting_tests_before_its_seconds(tmp_path):
    """Without an outer limit the suite ends itself: no test starts with under --reserve seconds left, the
    verdict is written, the tests never started are listed."""
    slow = slowdown()
    cmd = _suite_cmd(tmp_path, "--seconds", str(3 * slow), "--reserve", str(slow), sleep=0.25 * slow)
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60 + 30 * slow,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    verdict, ran = _verdict(tmp_path)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "AssertionError: planted: two is not three" in verdict and "| time up |" in verdict, verdict
    assert 4 <= len(ran) < 43 and "Not run (core, " in verdict and "- running when the suite was cut" not in verdict


def test_duplicates_left_out_run_a_plan_that_stays():
    """The time-boxed session leaves out the head op's 'auto' cases on CUDA: at every shape of those tests
    and on every GPU preset, 'auto' plans exactly what the strategy it picks plans when forced (same kernels,
    same chunks), and that forced case stays in the suite. The pattern takes those cases and no other."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_gpu_head as head_tests
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
        sys.path.remove(str(ROOT / "tests"))
    from ludic_fast.ops.plan import PRESETS, plan_head

    shapes = {(c.n, c.v, c.d, c.dtype) for c in head_tests.SIZES + head_tests.OPTIONS} | {(16384, 151936, 64, "bf16")}
    for preset in ("h100", "h200", "a100"):
        for n, v, d, dt in shapes:
            auto = plan_head(n, d, v, dtype=head_tests.DTYPES[dt], mode="generic", device=PRESETS[preset])
            assert auto.strategy in head_tests.STRATEGIES
            forced = plan_head(n, d, v, dtype=head_tests.DTYPES[dt], mode="generic", device=PRESETS[preset],
                               strategy=auto.strategy)
            assert auto == forced, (preset, n, v, d, dt)
    suite = _suite_module()
    ids = [f"tests/gpu/test_gpu_head.py::test_head_matches_reference[cuda-{c.id}-{s}]"
           for c in head_tests.SIZES + head_tests.OPTIONS for s in head_tests.STRATEGIES]
    ids += [f"tests/gpu/test_gpu_head.py::test_more_than_2_to_the_31_logits[cuda-{s}]" for s in head_tests.STRATEGIES]
    ids += ["tests/gpu/test_gpu_head.py::test_head_matches_reference[cpu-fp32-n1-v1021-d72-auto]",
            "tests/interpret/test_head_kernels.py::test_head_matches_reference[fp32-v1021-n3-fused]"]
    dropped = [i for i in ids if any(re.search(p, i) for p, _ in suite.DUPLICATES)]
    assert dropped == [i for i in ids if i.startswith("tests/gpu/") and "[cuda-" in i and i.endswith("-auto]")]
    assert len(dropped) == len(head_tests.SIZES + head_tests.OPTIONS) + 1


def _suite_module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_suite


def test_suite_times_per_file(tmp_path):
    """The seconds a suite run spent per test file, from its jsonl's 'finish' rows (hand-made rows)."""
    rows = [{"finish": "tests/a.py::t1", "seconds": 1.5}, {"start": "tests/a.py::t2"},
            {"finish": "tests/a.py::t2", "seconds": 0.5}, {"finish": "tests/b.py::t[x]", "seconds": 4.0}]
    path = tmp_path / "suite-core.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = _plan().suite_times(path).splitlines()
    assert lines[2:] == ["| tests/b.py | 1 | 4.0 | 4.00 |", "| tests/a.py | 2 | 2.0 | 1.00 |"]


def _kill_session(sid: int) -> None:
    """SIGKILL to every process of session `sid` (`timeout` puts each stage in a process group of its own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
            if int(fields[3]) == sid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile


def test_a_call_killed_mid_profile_still_leaves_its_finished_runs_in_out(tmp_path):
    """The device machine kills a call at its time limit (SIGKILL to the whole call, no trap runs): the
    profile's runs that ended before are in the call's $OUT already (profile.md, profile.jsonl), as the race's
    table is; before, the stage copied them there only at its end, so nothing came back."""
    res, out = tmp_path / "results", tmp_path / "out"
    proc = subprocess.Popen(["bash", str(SCRIPT), "rehearse", "run2"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PY": sys.executable, "RESULTS": str(res), "OUT": str(out),
                                 "STAGES": "e2e profile", "OMP_NUM_THREADS": "1"})
    jsonl = out / "profile.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (jsonl.is_file() and jsonl.read_text().count("\n") >= 1) and proc.poll() is None:
            assert time.monotonic() < deadline, "no profile run ended in 300 s"
            time.sleep(0.2)
    finally:  # as the machine ends a call: every process of it at once, nothing after this runs
        _kill_session(proc.pid)
        proc.wait()
    first = json.loads(jsonl.read_text().splitlines()[0])
    assert first["path"] == "ours-packed"
    assert "| phase | ours-packed |" in (out / "profile.md").read_text()
    assert "| ours-packed |" in (out / "trainer_e2e.md").read_text()


def test_shards_run_every_test_once_side_by_side(tmp_path):
    """--shards 3: three pytest processes at once, each every third test of the group's order; together they
    run each test exactly once, and the verdict has a row per shard and the planted failure."""
    cmd = _suite_cmd(tmp_path, "--seconds", "600", "--shards", "3", sleep=0.01)
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    verdict, ran = _verdict(tmp_path)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    finished = _finished(tmp_path, "suite-core.*.jsonl")
    assert sorted(finished) == sorted(set(finished)) and len(finished) == 44 and len(ran) == 44
    assert all(f"| core.{i} | " in verdict for i in range(3)) and "AssertionError: planted: two is not three" in verdict
    assert verdict.startswith("# GPU suite verdict: NOT green"), verdict


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout not installed")
def test_sharded_verdict_survives_the_stages_outer_limit(tmp_path):
    """Three shards cut by the outer `timeout` mid-suite: the verdict lists every test any shard finished, says
    it was cut, and no shard's pytest outlives the driver."""
    cmd = _suite_cmd(tmp_path, "--seconds", "600", "--shards", "3", sleep=0.5)
    returncode, out, err = _cut_by_outer_timeout(tmp_path, cmd, 8, "suite-core.*.jsonl")
    verdict, ran = _verdict(tmp_path)
    assert returncode == 124, out[-2000:] + err[-2000:]
    assert "cut: SIGTERM" in verdict and "AssertionError: planted: two is not three" in verdict, verdict
    finished = _finished(tmp_path, "suite-core.*.jsonl")
    assert 8 <= len(finished) < 44 and sorted(line.split("`")[1] for line in ran) == sorted(finished)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "test_cut.py")], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_a_shards_rewrite_after_the_sigterm_write_still_says_cut(tmp_path):
    """The outer `timeout` signals the shards' pytest too: a shard's thread sees its process ended and rewrites
    the verdict after the SIGTERM handler wrote it (a race CI lost once). That later rewrite still says the suite
    was cut, and a shard that had not ended yet is marked cut, not running."""
    suite = _suite_module().Suite(tmp_path, "core", 60.0)
    (tmp_path / "suite-core.0.jsonl").write_text(json.dumps({"finish": "tests/t.py::a", "seconds": 0.1}) + "\n")
    suite.groups.append({"group": "core.0", "path": tmp_path / "suite-core.0.jsonl", "hung": [], "state": None})
    suite.write(cut="SIGTERM (the stage's outer time limit)")
    suite.write()  # the shard's thread, after the handler
    verdict = (tmp_path / "suite-core-verdict.md").read_text()
    assert verdict.startswith("# GPU suite verdict: incomplete"), verdict
    assert "; cut: SIGTERM (the stage's outer time limit)." in verdict, verdict
    assert "| core.0 | 1 | 0 | 0 | 0 | 0 | 0 | 0 | cut |" in verdict, verdict


def test_a_shard_restarted_after_a_hang_keeps_its_share(tmp_path):
    """A shard whose test hangs restarts without the tests it ran and the hung one, and runs only the rest of its
    own share: across two shards each test ends exactly once (the TMA variant is not in the core group)."""
    (tmp_path / "test_injected.py").write_text(INJECTED_TESTS)
    slow = slowdown()
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--out", str(tmp_path / "out"), "--group", "core",
           "--test-seconds", str(2 * slow), "--seconds", "600", "--shards", "2", "--tests",
           str(tmp_path / "test_injected.py")]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120 + 30 * slow,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    verdict = (tmp_path / "out" / "suite-core-verdict.md").read_text()
    ended = sorted(n.split("::")[-1] for n in _finished(tmp_path, "suite-core.*.jsonl"))
    assert ended == ["test_injected_after_the_hang", "test_injected_failure"], ended  # each once, the hang apart
    assert verdict.count("hung (core.") == 1 and "test_injected_tma_variant" not in verdict, verdict
