"""The plans `ludic_fast.ops.plan.plan_head` picks, with their predicted times, as the Markdown tables of
docs/kernels.md. Run: `python bench/plan_table.py [--device h100] [--budget 4GiB]`.

Table 1: the head op (logprob + entropy, forward + backward, generic mode) and the CISPO loss (fused-loss
mode, on the 3/4 of the rows that are action tokens) at the default budget (or --budget), bf16 inputs.
Table 2: the head op's and CISPO's predicted time and transient memory against the budget.
Table 3: the model against the times measured on an H100 (2026-11-23, commit 6cccb55, the kernels of that
commit, `plan.MEASURED_KERNELS`), at the chunk sizes that were measured.
`--measured results.json`: instead, this release's model against a GPU bench run (`ludic-fast bench --preset
gpu`): each of our head-op and CISPO cases beside its predicted time and TRL's measured time.
"""

from __future__ import annotations

import argparse

import torch

from ludic_fast.benchmark.cli import load_results
from ludic_fast.benchmark.report import scored_rows
from ludic_fast.benchmark.runner import CaseResult
from ludic_fast.ops.plan import MEASURED_KERNELS, GiB, plan_head

SHAPES = {
    "anchor": (8192, 4096, 151936),
    "qwen0.5b": (16384, 896, 151936),
    "llama8b": (32768, 4096, 128256),
    "N=64": (64, 4096, 151936),
    "N=512": (512, 4096, 151936),
    "N=2048": (2048, 4096, 151936),
}
#: measured on an H100 (ms): (shape, op, strategy, chunk elements in Mi) -> time; CISPO on 3/4 of the rows
MEASURED_MS = {
    ("anchor", "head", "workspace", 64): 70.8, ("qwen0.5b", "head", "workspace", 64): 47.3,
    ("llama8b", "head", "workspace", 64): 243.5, ("N=64", "head", "workspace", 64): 4.5,
    ("N=64", "head", "fused", 64): 10.7, ("N=512", "head", "workspace", 64): 7.0,
    ("N=512", "head", "fused", 64): 43.7, ("N=2048", "head", "workspace", 64): 19.2,
    ("N=2048", "head", "fused", 64): 166.7,
    ("anchor", "cispo", "workspace", 16): 215.5, ("anchor", "cispo", "workspace", 64): 69.2,
    ("anchor", "cispo", "workspace", 256): 48.1, ("anchor", "cispo", "workspace", 1024): 42.3,
    ("qwen0.5b", "cispo", "workspace", 64): 48.3, ("qwen0.5b", "cispo", "workspace", 256): 32.9,
    ("qwen0.5b", "cispo", "workspace", 1024): 29.8, ("llama8b", "cispo", "workspace", 64): 205.4,
    ("llama8b", "cispo", "workspace", 256): 148.2, ("llama8b", "cispo", "workspace", 1024): 139.8,
}
#: TRL 1.16's ChunkedLogProbFunction (head) and its head + cispo loss (ms, same rows), measured on the H100
TRL_MS = {("anchor", "head"): 62.7, ("qwen0.5b", "head"): 35.3, ("llama8b", "head"): 218.7, ("N=64", "head"): 7.5,
          ("N=512", "head"): 8.1, ("N=2048", "head"): 18.3, ("anchor", "cispo"): 47.3, ("qwen0.5b", "cispo"): 25.8,
          ("llama8b", "cispo"): 157.3}


def _call(name: str, op: str) -> tuple[int, int, int, str]:
    n, d, v = SHAPES[name]
    return (n if op == "head" else n * 3 // 4), d, v, ("generic" if op == "head" else "fused_loss")


def _fmt_block(rows: int, cols: int, n: int, v: int) -> str:
    return f"{'all ' if rows == n else ''}{rows} x {'V' if cols == v else cols}"


def _dw_group(p, n: int) -> str:
    rows = p.stage_rows or p.token_rows
    return f"dW per {'all ' if rows == n else ''}{rows} rows{' (staged)' if p.stage_rows else ''}"


def curve_table(device: str) -> str:
    """The head op's (generic mode) and CISPO's (fused-loss mode) predicted time and transient memory against
    the memory budget ("tl.dot": the fused strategy's plan; "held": the head op keeps its forward's logits)."""
    budgets = (1, 2, 3, 4, 6, 8, 12)
    out = ["| shape | op | " + " | ".join(f"{b} GiB" for b in budgets) + " |", "|---|---|" + "---|" * len(budgets)]
    for op, name in ((op, name) for op in ("head", "cispo") for name in ("anchor", "qwen0.5b", "llama8b")):
        n, d, v, mode = _call(name, op)
        cells = []
        for b in budgets:
            p = plan_head(n, d, v, mode=mode, device=device, memory_budget=b * GiB)
            notes = " tl.dot" * (p.strategy == "fused") + " held" * p.hold_logits + " (over)" * (not p.fits)
            cells.append(f"{p.predicted_s * 1e3:.1f} ms / {p.transient_bytes / GiB:.2f}{notes}")
        out.append(f"| {name} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plans_table(device: str, budget: str | None) -> str:
    out = [
        "| shape | op | rows scored | strategy | forward chunk | backward block / dW group | budget GiB "
        "| transient GiB | predicted ms | TRL 1.16 measured ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SHAPES:
        for op in ("head", "cispo"):
            n, d, v, mode = _call(name, op)
            p = plan_head(n, d, v, dtype=torch.bfloat16, mode=mode, device=device, memory_budget=budget)
            bwd = _fmt_block(p.grad_rows, p.grad_cols, n, v) + " (held)" * p.hold_logits if mode == "generic" \
                else _dw_group(p, n)
            trl = TRL_MS.get((name, op))
            out.append(
                f"| {name} | {op} | {n} | {p.strategy} | {_fmt_block(p.token_rows, p.vocab_cols, n, v)} | {bwd} "
                f"| {p.memory_budget / GiB:.2f} | {p.transient_bytes / GiB:.2f} | {p.predicted_s * 1e3:.1f} "
                f"| {'–' if trl is None else f'{trl:.1f}'} |"
            )
    return "\n".join(out)


def calibration_table() -> str:
    out = [
        "| shape | op | strategy | chunk (Mi elements) | predicted ms | measured ms | predicted / measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, op, strategy, mi), ms in MEASURED_MS.items():
        n, d, v, mode = _call(name, op)
        p = plan_head(n, d, v, mode=mode, device="h100", strategy=strategy if op == "head" else None,
                      chunk_elements=mi * 2**20, kernels=MEASURED_KERNELS)
        out.append(f"| {name} | {op} | {strategy} | {mi} | {p.predicted_s * 1e3:.1f} | {ms} "
                   f"| {p.predicted_s * 1e3 / ms:.2f} |")
    return "\n".join(out)


#: (GPU bench implementation, workload) -> (plan mode, triton strategy it forces; None: auto)
BENCH_PLANS = {
    ("ours-generic", "head"): ("generic", None),
    ("ours-triton-workspace", "head"): ("generic", "workspace"),
    ("ours-triton-fused", "head"): ("generic", "fused"),
    ("ours-fused", "cispo"): ("fused_loss", None),
    ("ours-fused-workspace", "cispo"): ("fused_loss", "workspace"),
    ("ours-fused-tl-dot", "cispo"): ("fused_loss", "fused"),
}


def measured_table(results: list[CaseResult], device: str) -> str:
    """Each of our GPU bench cases (`BENCH_PLANS`, default budget) beside the plan the model makes for it:
    predicted against measured time, and the measured time over TRL's on the same shape and workload."""
    out = [
        "| shape | workload | implementation | rows scored | plan | predicted ms | measured ms "
        "| predicted / measured | measured / TRL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    trl = {(r.workload, r.shape): r.median_s for r in results if r.impl == "trl" and r.status == "ok"}
    for r in results:
        if (r.impl, r.workload) not in BENCH_PLANS or r.status != "ok":
            continue
        mode, strategy = BENCH_PLANS[(r.impl, r.workload)]
        rows, sh = scored_rows(r), r.shape
        p = plan_head(rows, sh.d, sh.v, dtype=sh.torch_dtype, mode=mode, device=device, strategy=strategy)
        ms, t = r.median_s * 1e3, trl.get((r.workload, sh))
        out.append(
            f"| {sh.n_tokens} x {sh.d} x {sh.v} | {r.workload} | {r.impl} | {rows} | {p.strategy} "
            f"| {p.predicted_s * 1e3:.1f} | {ms:.1f} | {p.predicted_s * 1e3 / ms:.2f} "
            f"| {'–' if t is None else f'{r.median_s / t:.2f}'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="h100", help="a DeviceModel preset: h100, h200, a100, cpu")
    ap.add_argument("--budget", default=None, help="memory budget, e.g. 4GiB (default: the device's)")
    ap.add_argument("--measured", metavar="RESULTS_JSON", default=None,
                    help="only the table of a GPU bench's results.json (ludic-fast bench --preset gpu) against "
                    "the model's predictions for --device")
    args = ap.parse_args(argv)
    if args.measured is not None:
        print(measured_table(load_results(args.measured)[0], args.device))
        return
    print(plans_table(args.device, args.budget))
    print()
    print(curve_table(args.device))
    print()
    print(calibration_table())


if __name__ == "__main__":
    main()
