"""The GPU tooling's CPU-checkable parts: bench/gpu_session.sh (syntax, stage validation, the dry run's
commands: the project and the wheels go in with --no-deps, results land in bench/results/gpu), `make
test-gpu` (never installs torch; stops with a message naming CUDA when there is none) and
tools/gpu_requirements.py (never names torch or triton)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_session.sh"


def _bash(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_session_script_dry_run(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "trl-1.16.0-py3-none-any.whl").write_bytes(b"")
    out = _bash("test", "bench-small", "suite", DRY_RUN="1", WHEELS=str(wheels), OUT=str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("--no-index --no-deps" in x and "--target /tmp/site" in x and "trl-1.16.0" in x for x in lines)
    assert any("pip install" in x and "--no-deps" in x and x.endswith("-e .") for x in lines)
    limit = re.compile(r"\+ timeout --kill-after=10 5[0-9][0-9] ")  # within the call's 560 s, outputs collected
    assert any(limit.match(x) and "make test-gpu" in x and "bench/results/gpu/test-gpu.log" in x for x in lines)
    assert any(limit.match(x) and "-m not gpu" in x for x in lines)
    assert any("--preset gpu --shapes 64x4096x151936" in x and "bench/results/gpu/small" in x for x in lines)
    assert any("-m not gpu" in x for x in lines)
    assert not any("torch==" in x or "install torch" in x for x in lines)


def test_stages_of_one_call_share_its_seconds(tmp_path):
    """A stage gets what is left of CALL_SECONDS; with under 30 s left it is skipped, and says so."""
    out = _bash("e2e", DRY_RUN="1", CALL_SECONDS="100", OUT=str(tmp_path / "out"))
    assert out.returncode == 0 and any(x.startswith("+ timeout --kill-after=10 10") and "bench-e2e-gpu" in x
                                       for x in out.stdout.splitlines()), out.stdout
    out = _bash("e2e", DRY_RUN="1", CALL_SECONDS="20", OUT=str(tmp_path / "out"))
    assert "bench-e2e-gpu" not in out.stdout and "stage 'e2e' skipped: 20s of the call's 20s left" in out.stderr


def test_session_script_rejects_unknown_stages_before_installing():
    out = _bash("test", "tset", DRY_RUN="1")
    assert out.returncode == 2 and "unknown stage 'tset'" in out.stderr and "pip" not in out.stdout
    usage = _bash()
    assert usage.returncode == 2 and "bench-large" in usage.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_gpu_keeps_the_machine_torch_and_needs_cuda():
    plan = subprocess.run(["make", "-n", "test-gpu"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "--no-deps" in plan and "torch==" not in plan and "--preset gpu-key" in plan
    assert '-m "gpu or interpret" tests/gpu tests/interpret' in plan
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
