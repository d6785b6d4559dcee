"""Run benchmark cases, each in a fresh Python process so that peak memory belongs to one implementation.

`run_case` spawns `python -m ludic_fast.benchmark.worker <spec>` with the thread count pinned
(`torch.set_num_threads`, OMP/MKL variables) and parses its one RESULT line, or, with `one_process` (the
GPU presets: the CUDA allocator's peak is reset per case, so one process measures each case's own peak),
measures in this process, recording any exception (out of memory, a compile error) as the case's failure
and freeing the device before the next case (a case over `Options.timeout_s` ends the process); `run_suite` walks
implementations x workloads x shapes, skipping what an implementation does not cover (with the reason)
and measuring the workload-independent GEMM floors once per shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ludic_fast.benchmark.impls import get_impl, preload
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
    timeout_s: float = 3600.0  # per case: a subprocess is killed, an in-process case ends the process
    in_process: bool = False  # measure here, not in a subprocess (CPU: tests only, the RSS peak is then shared)


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


def _in_process_measure(spec: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """`measure` here; an exception becomes (None, 'Type: message'). A case still running after `timeout_s`
    ends the process (`faulthandler.dump_traceback_later`: every thread's stack on stderr, exit status 1; a
    hang inside a CUDA call cannot be interrupted otherwise), so the results saved so far are what remains.
    Afterwards the device memory is released and torch.compile's caches are reset, so every case starts
    alike (a peer compiled at many shapes would otherwise reach dynamo's recompile limit and silently run
    uncompiled)."""
    preload()  # the peers' imports are no part of a case's time
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.__stderr__)  # the process's own stderr
    try:
        return measure(spec), None
    except Exception as exc:  # a peer's failure of any kind is a result to report, not a crash of the suite
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    finally:
        faulthandler.cancel_dump_traceback_later()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()


class BenchStopped(BaseException):
    """A SIGINT or SIGTERM arrived during `stop_on_signals` (a BaseException, as KeyboardInterrupt: no
    `except Exception` of a case records it as the case's failure)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """The first SIGINT / SIGTERM raises `BenchStopped` where the run is (a subprocess case is killed with it);
    a second one ends the process at once with status 128 + its number. The main thread only; the previous
    handlers come back at the end."""

    def second(signum: int, frame: object) -> None:
        os._exit(128 + signum)

    def first(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, second)
        raise BenchStopped(signum)

    previous = {sig: signal.signal(sig, first) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within: a SIGINT / SIGTERM waits for the block's end (a table being saved is saved whole), then goes to
    the handler of the moment (`stop_on_signals`' outside it). The main thread only."""
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


def run_case(impl: str, workload: str, shape: Shape, opts: Options) -> CaseResult:
    """Measure one case (or say why it is skipped / how it failed)."""
    info = get_impl(impl)
    base = CaseResult(impl, info.role, workload, shape, status="skipped")
    why = info.unavailable(get_workload(workload), opts.device)
    if why is not None:
        base.reason = why
        return base
    spec = _spec(impl, workload, shape, opts)
    if opts.in_process:
        data, failure = _in_process_measure(spec, opts.timeout_s)
    else:
        try:
            data, failure = _subprocess_measure(spec, opts), None
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            data, failure = None, str(exc)[-500:]
    if data is None:
        base.status, base.reason = "failed", failure or "no result"
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
    on_result: Callable[[list[CaseResult]], None] | None = None,
) -> list[CaseResult]:
    """Every implementation on every workload and shape; the floors once per shape and scored-row count,
    reused for each workload that scores as many rows. `on_result(results so far)` after every case (the CLI
    saves them, so a run stopped midway keeps what it measured)."""
    impls, workloads = list(impls), list(workloads)
    results: list[CaseResult] = []
    for shape in shapes:
        floor_cache: dict[tuple[str, int], CaseResult] = {}
        for workload in workloads:
            for impl in impls:
                key = (impl, get_workload(workload).scored_rows(shape))
                cached = floor_cache.get(key)
                if cached is not None:
                    results.append(dataclasses.replace(cached, workload=workload))
                else:
                    res = run_case(impl, workload, shape, opts)
                    if get_impl(impl).workload_independent and res.status == "ok":
                        floor_cache[key] = res
                    results.append(res)
                    log(_log_line(res))
                if on_result is not None:
                    on_result(results)
    return results


def _log_line(r: CaseResult) -> str:
    head = f"[{r.shape.label()}] {r.workload:9s} {r.impl:13s}"
    if r.status != "ok":
        return f"{head} {r.status}: {r.reason}"
    return f"{head} median {r.median_s:.3f}s min {r.min_s:.3f}s peak {r.peak_bytes / 2**30:.2f} GiB"
