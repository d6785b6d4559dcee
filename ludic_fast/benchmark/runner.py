"""Run benchmark cases, each in a fresh Python process so that peak memory belongs to one implementation.

`run_case` spawns `python -m ludic_fast.benchmark.worker <spec>` with the thread count pinned
(`torch.set_num_threads`, OMP/MKL variables) and parses its one RESULT line; `run_suite` walks
implementations x workloads x shapes, skipping what an implementation does not cover (with the reason)
and measuring the workload-independent GEMM floors once per shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ludic_fast.benchmark.impls import get_impl
from ludic_fast.benchmark.worker import RESULT_PREFIX, measure
from ludic_fast.benchmark.workloads import Shape, get_workload


@dataclass
class Options:
    """How each case is measured (see `worker.measure`)."""

    device: str = "cpu"
    threads: int = 2
    repeats: int = 3
    warmup: int = 1
    check_tokens: int = 256
    seed: int = 0
    timeout_s: float = 3600.0
    in_process: bool = False  # tests only: measure here instead of in a subprocess (peak memory is then shared)


@dataclass
class CaseResult:
    """One (implementation, workload, shape) measurement; status 'ok', 'skipped' or 'failed'."""

    impl: str
    role: str
    workload: str
    shape: Shape
    status: str
    reason: str = ""
    median_s: float | None = None
    min_s: float | None = None
    times_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    base_bytes: int | None = None
    errors: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shape"] = dataclasses.asdict(self.shape)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaseResult:
        return cls(**{**data, "shape": Shape(**data["shape"])})


def _spec(impl: str, workload: str, shape: Shape, opts: Options) -> dict[str, Any]:
    return {
        "impl": impl,
        "workload": workload,
        "shape": dataclasses.asdict(shape),
        "device": opts.device,
        "threads": opts.threads,
        "repeats": opts.repeats,
        "warmup": opts.warmup,
        "check_tokens": opts.check_tokens,
        "seed": opts.seed,
    }


def _subprocess_measure(spec: dict[str, Any], opts: Options) -> dict[str, Any]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(opts.threads)
    proc = subprocess.run(
        [sys.executable, "-m", "ludic_fast.benchmark.worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=opts.timeout_s,
        env=env,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"worker exited {proc.returncode}: " + " | ".join(tail))


def run_case(impl: str, workload: str, shape: Shape, opts: Options) -> CaseResult:
    """Measure one case (or say why it is skipped / how it failed)."""
    info = get_impl(impl)
    base = CaseResult(impl, info.role, workload, shape, status="skipped")
    why = info.unavailable(get_workload(workload), opts.device)
    if why is not None:
        base.reason = why
        return base
    spec = _spec(impl, workload, shape, opts)
    try:
        data = measure(spec) if opts.in_process else _subprocess_measure(spec, opts)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        base.status, base.reason = "failed", str(exc)[-500:]
        return base
    return dataclasses.replace(
        base,
        status="ok",
        median_s=data["median_s"],
        min_s=data["min_s"],
        times_s=data["times_s"],
        peak_bytes=data["peak_bytes"],
        base_bytes=data["base_bytes"],
        errors=data.get("errors", {}),
    )


def run_suite(
    impls: Iterable[str],
    workloads: Iterable[str],
    shapes: Iterable[Shape],
    opts: Options,
    log: Callable[[str], None] = print,
) -> list[CaseResult]:
    """Every implementation on every workload and shape; floors once per shape, reused for each workload."""
    impls, workloads = list(impls), list(workloads)
    results: list[CaseResult] = []
    for shape in shapes:
        floor_cache: dict[str, CaseResult] = {}
        for workload in workloads:
            for impl in impls:
                cached = floor_cache.get(impl)
                if cached is not None:
                    results.append(dataclasses.replace(cached, workload=workload))
                    continue
                res = run_case(impl, workload, shape, opts)
                if get_impl(impl).workload_independent and res.status == "ok":
                    floor_cache[impl] = res
                results.append(res)
                log(_log_line(res))
    return results


def _log_line(r: CaseResult) -> str:
    head = f"[{r.shape.label()}] {r.workload:9s} {r.impl:13s}"
    if r.status != "ok":
        return f"{head} {r.status}: {r.reason}"
    return f"{head} median {r.median_s:.3f}s min {r.min_s:.3f}s peak {r.peak_bytes / 2**30:.2f} GiB"
