"""The calls of a GPU session (bench/gpu_session.sh): their stages in priority order, each stage's seconds,
the benchmark cases of each bench stage, and the budget table that sizes them.

    python bench/gpu_plan.py budget                  # the budget table (Markdown)
    python bench/gpu_plan.py impls decisive          # a bench stage's implementations, in the order measured
    python bench/gpu_plan.py args decisive trl       # the `ludic-fast bench` arguments of one of them
    python bench/gpu_plan.py args decisive trl --tiny  # the same at the rehearsal's tiny shapes, on the CPU
    python bench/gpu_plan.py merge DIR               # DIR/<impl>/results.json -> DIR/results.json, .md
    python bench/gpu_plan.py seconds run1            # "stage seconds" lines of a call, for the script
    python bench/gpu_plan.py value e2e-paths         # a setting the script reads (e2e-paths, suite-prior)
    python bench/gpu_plan.py find-max-seconds 345    # a find-max stage's --find-max-seconds for its seconds
    python bench/gpu_plan.py suite-times JSONL       # a suite run's seconds per test file (to recalibrate)

Each implementation of a bench stage runs in its own `ludic-fast bench` process (a hang, which ends that
process at its per-case --timeout, costs only that implementation's remaining cases); `merge` joins their
tables into the stage's.

Calibrated from the H200 run of 6e98f8f (bench/results/gpu-runs/2026-11-28-h200, session-run1.log and
session-run2.log): a suite test took 0.68 s (369 tests in 250 s, pytest's start included; the jsonl of that run has
no per-test times, so one figure for every file); a trainer path of the end to end 35-45 s (40); a bench
implementation's process ~18 s of start (imports, inputs, Triton compiles) plus ~3 s a case (ours-generic: 4 cases
in 29 s at the anchor and N=512, 2 in 28 s at D=896); the stage's tables after its implementations ~12 s; setup
12-13 s. Bench-stage estimate = STAGE_START_S + IMPL_START_S per implementation + sum over cases of (CASE_OVERHEAD_S
+ runs x predicted seconds of one forward+backward), runs = warm-ups + timed runs + the error check. Predicted
seconds: ours from `ludic_fast.ops.plan.plan_head` (H100 preset, default budget; a stage's LEFTOVER_IMPLS are not
counted); TRL and Liger from their H100 measurements at that shape (2026-11-23) where there are some, else TRL 1.5x
and Liger 10x the 6NDV floor; the floor 6NDV / the preset's GEMM rate. The script's look-ups (impls, args, seconds,
value) import no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: (N, D, V) of the GPU benchmark, and the rehearsal's tiny stand-in for each (Llama-3-8B's, N=64 and N=2048 were
#: measured on the H200, bench/results/gpu-runs/2026-11-27-h200/shapes; kept for reruns)
SHAPES = {
    "anchor": ((8192, 4096, 151936), (256, 64, 4099)),
    "N=512": ((512, 4096, 151936), (64, 64, 4099)),
    "qwen0.5b": ((16384, 896, 151936), (512, 32, 4099)),
    "llama8b": ((32768, 4096, 128256), (512, 64, 3001)),
    "N=64": ((64, 4096, 151936), (16, 64, 4099)),
    "N=2048": ((2048, 4096, 151936), (128, 64, 4099)),
}
DECISIVE_IMPLS = ("ours-generic", "ours-fused", "trl", "gemm-fwd+bwd", "ours-generic-held")
#: a bench stage's last implementations, which its own seconds do not count: they run in what the call has
#: left, since the call's last stage gets all of it (gpu_session.sh) — run1's, once the sharded suite ends
#: early. The head op holding its forward's logits (memory_budget 4 N V) is no default: measured after the rest
LEFTOVER_IMPLS = {"decisive": ("ours-generic-held",)}
#: bench stage -> (shapes, workloads, implementations in the order measured: the goals' first). The decisive
#: stage measures the goals' two shapes, the anchor and Qwen2.5-0.5B's (D=896; N=512, measured in both H200 runs,
#: is no goal's); preference races DPO and distillation against Liger's fused linear losses; shapes times the
#: forced strategies at D=896 beside the default plan and TRL
BENCH_STAGES = {
    "decisive": (("anchor", "qwen0.5b"), ("head", "cispo"), DECISIVE_IMPLS),
    "preference": (("anchor",), ("dpo", "jsd"), ("ours-fused", "liger", "gemm-fwd+bwd")),
    "experimental": (("anchor",), ("head", "cispo"), ("ours-triton-fused-tma", "ours-fused-tl-dot-tma")),
    "shapes": (("qwen0.5b",), ("head", "cispo"), ("ours-fused", "trl", "ours-triton-fused", "ours-fused-tl-dot")),
}
#: call -> (its seconds, [(stage, seconds)] in the order run); each stage also stops when the call's time is up.
#: run1 + run2 fit one GPU loan of 15 minutes with the machine's start (~160 s at 6e98f8f: 840 s held for
#: 678 s of calls); run3 and run4 (the memory race: the largest batch each trainer fits) only when device time is
#: left after them, else in a later session, once run1 and run2 have run
CALLS = {
    "run1": (480, [("setup", 15), ("suite", 330), ("decisive", 135)]),
    "run2": (230, [("setup", 15), ("e2e", 95), ("profile", 120)]),
    "run3": (300, [("setup", 15), ("preference", 95), ("shapes", 120), ("experimental", 70)]),
    "run4": (360, [("setup", 15), ("find-max", 345)]),
}
#: gpu/interpret-marked tests (pytest --collect-only): all, the experimental (TMA) ones among them, and the core
#: ones the session leaves out as duplicates (gpu_suite.DUPLICATES); measured seconds a test on the H200
SUITE_TESTS, SUITE_TMA_TESTS, SUITE_DUPLICATES, SUITE_TEST_S, SUITE_TEST_LIMIT_S = 518, 12, 50, 0.68, 60
#: the suite's order: the tests that failed or never finished in this run go first (its jsonl files: one per
#: shard from a sharded run, suite-core.0.jsonl ...)
SUITE_PRIOR = ("bench/results/gpu-runs/2026-11-28-h200/run1/suite-core.jsonl",)
#: measured on the H200 (2026-11-27, 2026-11-28): a path's process start, model build, warm-up and 3 steps took
#: 35-45 s; the race of the trainer issue: ours packed against stock TRL (the reference path was measured)
E2E_PATHS, E2E_PATH_S = ("ours-packed", "trl"), 40.0
#: find-max: the race's first rows (E2E_PATHS x E2E_PATH_S) and a margin, kept from the stage's seconds before
#: the search's (trainer_e2e --find-max-seconds, `find_max_seconds`)
FIND_MAX_RESERVE_S = int(len(E2E_PATHS) * E2E_PATH_S) + 25
STAGE_START_S, IMPL_START_S, CASE_OVERHEAD_S, RUNS = 12.0, 18.0, 3.0, 2 + 5 + 1
#: what each stage took in the 6e98f8f run (bench/results/gpu-runs/2026-11-28-h200/run*/session-run*.log)
MEASURED = {"setup": "13 / 12", "suite": "260 (cut: 369 of 496 tests)", "decisive": "144 (the floor cut)",
            "e2e": "145 (cut: 3 paths, --find-max not reached)", "shapes": "104 (3 of 7 implementations)",
            "experimental": "not run", "profile": "new", "preference": "new",
            "find-max": "not reached (e2e cut at 145 s)"}
TRL_MS = {("anchor", "head"): 62.7, ("qwen0.5b", "head"): 35.3, ("llama8b", "head"): 218.7, ("N=64", "head"): 7.5,
          ("N=512", "head"): 8.1, ("N=2048", "head"): 18.3, ("anchor", "cispo"): 62.8, ("qwen0.5b", "cispo"): 34.1,
          ("llama8b", "cispo"): 207.8}
LIGER_MS = {("anchor", "cispo"): 720.0, ("llama8b", "cispo"): 2420.0}


def _rows(shape: str, workload: str) -> int:
    n = SHAPES[shape][0][0]
    return n if workload == "head" else n * 3 // 4  # CISPO scores the action rows: 3/4 of the tokens


def case_seconds(impl: str, shape: str, workload: str) -> float | None:
    """Predicted seconds of one forward+backward of a case on an H100; None when the model has no estimate."""
    import torch

    from ludic_fast.ops.plan import H100, plan_head

    _, d, v = SHAPES[shape][0]
    rows = _rows(shape, workload)
    floor = 6.0 * rows * d * v / H100.bf16_flops
    if impl == "gemm-fwd+bwd":
        return floor
    if impl in ("trl", "liger"):
        ms = (TRL_MS if impl == "trl" else LIGER_MS).get((shape, workload))
        return 1.5 * floor if ms is None and impl == "trl" else None if ms is None else ms / 1e3
    if impl.startswith("ours"):
        mode = "fused_loss" if workload != "head" and impl.startswith("ours-fused") else "generic"
        strategy = "fused" if "tl-dot" in impl or "triton-fused" in impl else None
        return plan_head(rows, d, v, dtype=torch.bfloat16, mode=mode, device="h100", strategy=strategy).predicted_s
    return None


def stage_estimate(stage: str) -> tuple[float, list[str]]:
    """(predicted seconds, notes) of a bench stage: cases the model cannot price count 10 x the floor."""
    from ludic_fast.benchmark.impls import get_impl
    from ludic_fast.benchmark.workloads import get_workload
    from ludic_fast.ops.plan import H100

    shapes, workloads, impls = BENCH_STAGES[stage]
    impls = tuple(i for i in impls if i not in LEFTOVER_IMPLS.get(stage, ()))
    total, notes = STAGE_START_S + IMPL_START_S * len(impls), []
    for shape in shapes:
        for workload in workloads:
            for impl in impls:
                if get_impl(impl).covers(get_workload(workload)) is not None:
                    continue  # skipped by the bench at once
                s = case_seconds(impl, shape, workload)
                if s is None:
                    _, d, v = SHAPES[shape][0]
                    s = 10 * 6.0 * _rows(shape, workload) * d * v / H100.bf16_flops
                    notes.append(f"{impl} at {shape} {workload}: no model, 10x the floor")
                total += CASE_OVERHEAD_S + RUNS * s
    return total, notes


def suite_tests() -> int:
    """The core tests the session's suite runs: every gpu/interpret-marked test but the TMA ones and the
    duplicates."""
    return SUITE_TESTS - SUITE_TMA_TESTS - SUITE_DUPLICATES


def stage_seconds(stage: str, given: int) -> str:
    """The estimate column of a stage."""
    if stage in BENCH_STAGES:
        tma_tests = SUITE_TMA_TESTS * SUITE_TEST_S if stage == "experimental" else 0
        return f"{stage_estimate(stage)[0] + tma_tests:.0f}"
    if stage == "suite":
        return f"{suite_tests() * SUITE_TEST_S:.0f}"
    if stage == "e2e":
        return f"{len(E2E_PATHS) * E2E_PATH_S:.0f}"
    if stage == "profile":
        return f"≤ {given - 10} (its --seconds)"
    if stage == "find-max":
        return f"≤ {given} ({find_max_seconds(given)} of search)"
    return "13"


def find_max_seconds(stage_seconds: int) -> int:
    """--find-max-seconds of a find-max stage: what the race's first rows and the margin leave (at least 10)."""
    return max(10, stage_seconds - FIND_MAX_RESERVE_S)


def budget_table() -> str:
    out = ["| call | stage | seconds given | estimate s | at 6e98f8f s | what it yields |", "|---|---|---|---|---|---|"]
    what = {
        "setup": "wheels and the project installed (--no-index), card / driver / versions in env.txt",
        "suite": f"the GPU suite's verdict: {suite_tests()} core tests ({SUITE_DUPLICATES} duplicates left out), "
                 f"each under {SUITE_TEST_LIMIT_S} s, the last run's failed and unfinished ones first; 3 shards at "
                 "once (the estimate is serial)",
        "decisive": "head op + CISPO at the goals' shapes, the anchor and D=896: ours, TRL, the 6NDV floor; "
                    "then, in what the call has left, the head op holding its logits (ours-generic-held)",
        "experimental": f"the TMA variants: their {SUITE_TMA_TESTS} tests, then their bench cases at the anchor",
        "shapes": "head op + CISPO at Qwen2.5-0.5B's shape (D=896), each strategy forced beside the default and TRL",
        "preference": "DPO and distillation (JSD) at the anchor: ours fused, Liger's fused linear losses, the floor",
        "find-max": f"the largest sequences per step each of {', '.join(E2E_PATHS)} fits (trainer_e2e --find-max)",
        "e2e": f"the trainer race (Qwen2.5-0.5B shape, 16 x 1024 tokens): {', '.join(E2E_PATHS)}",
        "profile": "bench/trainer_profile.py: where a training step's time goes, per path (its default paths)",
    }
    for call, (seconds, stages) in CALLS.items():
        for stage, given in stages:
            out.append(f"| {call} (≤ {seconds} s) | {stage} | {given} | {stage_seconds(stage, given)} | "
                       f"{MEASURED[stage]} | {what[stage]} |")
        out.append(f"| {call} | total | {sum(g for _, g in stages)} | | | |")
    return "\n".join(out)


def suite_times(jsonl: Path) -> str:
    """Per test file of a gpu_suite jsonl: tests finished, their seconds (the 'finish' rows' times), the mean
    (a run before the per-test times were recorded gives counts only)."""
    files: dict[str, list[float]] = {}
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        if "finish" in row:
            files.setdefault(row["finish"].split("::")[0], []).append(row.get("seconds") or float("nan"))
    out = ["| file | tests | seconds | s / test |", "|---|---|---|---|"]
    for name, secs in sorted(files.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"| {name} | {len(secs)} | {sum(secs):.1f} | {sum(secs) / len(secs):.2f} |")
    return "\n".join(out)


def bench_args(stage: str, impl: str, tiny: bool) -> list[str]:
    shapes, workloads, _ = BENCH_STAGES[stage]
    triples = ",".join("x".join(map(str, SHAPES[s][1 if tiny else 0])) for s in shapes)
    args = ["--preset", "gpu", "--shapes", triples, "--workloads", ",".join(workloads), "--impls", impl]
    return args + (["--device", "cpu", "--repeats", "1", "--warmup", "1", "--check-tokens", "16"] if tiny else [])


def merge(folder: Path) -> int:
    """The results of folder/<impl>/results.json (in the stage's order) as folder/results.json and .md; the
    number of cases."""
    from ludic_fast.benchmark.cli import load_results, write_tables

    loaded = {impl: load_results(p) for impl in BENCH_STAGES[folder.name][2]
              if (p := folder / impl / "results.json").exists()}
    if not loaded:
        return 0
    status = [f"{impl}: {loaded[impl][1].get('status', 'complete') if impl in loaded else 'no result (its log)'}"
              for impl in BENCH_STAGES[folder.name][2]]
    first = next(iter(loaded.values()))[1]
    meta = {**first, "command": "; ".join(m["command"] for _, m in loaded.values()), "status": "; ".join(status)}
    results = [r for rs, _ in loaded.values() for r in rs]
    write_tables(results, meta, folder)
    return len(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("budget", "impls", "args", "merge", "seconds", "value", "suite-times",
                                    "find-max-seconds"))
    p.add_argument("name", nargs="?",
                   help="the stage (impls, args), its folder (merge), the call (seconds), the setting (value) or "
                        "the stage's seconds (find-max-seconds)")
    p.add_argument("impl", nargs="?", help="args: the implementation")
    p.add_argument("--tiny", action="store_true", help="args: the rehearsal's shapes, on the CPU")
    a = p.parse_args(argv)
    if a.what == "budget":
        print(budget_table())
    elif a.what == "suite-times":
        if a.name is None or not Path(a.name).is_file():
            p.error(f"suite-times needs a gpu_suite jsonl, got {a.name!r}")
        print(suite_times(Path(a.name)))
    elif a.what == "find-max-seconds":
        if a.name is None or not a.name.isdigit():
            p.error(f"find-max-seconds needs the stage's seconds, got {a.name!r}")
        print(find_max_seconds(int(a.name)))
    elif a.what == "value":
        values = {"e2e-paths": ",".join(E2E_PATHS), "suite-prior": " ".join(SUITE_PRIOR)}
        if a.name not in values:
            p.error(f"value needs one of {', '.join(values)}")
        print(values[a.name])
    elif a.what == "merge":
        folder = Path(a.name or "")
        if folder.name not in BENCH_STAGES:
            p.error(f"merge needs a stage's folder, named one of {', '.join(BENCH_STAGES)}")
        print(f"{merge(folder)} cases in {folder}/results.md")
    elif a.what in ("impls", "args"):
        if a.name not in BENCH_STAGES:
            p.error(f"{a.what} needs a bench stage: one of {', '.join(BENCH_STAGES)}")
        impls = BENCH_STAGES[a.name][2]
        if a.what == "impls":
            print(" ".join(impls))
        elif a.impl not in impls:
            p.error(f"args {a.name} needs one of its implementations: {', '.join(impls)}")
        else:
            print(" ".join(bench_args(a.name, a.impl, a.tiny)))
    else:
        if a.name not in CALLS:
            p.error(f"seconds needs a call: one of {', '.join(CALLS)}")
        seconds, stages = CALLS[a.name]
        print(f"call {seconds}")
        print("\n".join(f"{stage} {given}" for stage, given in stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
