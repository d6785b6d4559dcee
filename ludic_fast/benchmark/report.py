"""Markdown tables and PNG plots of benchmark results.

Per (shape, workload) the results table lists every implementation with the rows it pushes through the
head, median / min time, µs per scored row (the same denominator for every implementation: the rows the
workload needs), peak memory, extra memory over the inputs, the ratios time / reference, time / GEMM floor
(the three bare GEMMs of the scored rows, 6NDV), peak / reference, and the max errors against the float64
reference. The "ours vs" table gives every ratio of each of our modes against every other implementation
(time and peak memory), with the project's goals for the fused-loss mode at the shape they are stated for
(`GOAL_SHAPES`: the CPU key table, N=2048 D=896 V=151936 fp32):

    time  <= 1.0 x bare GEMMs,  <= 0.75 x reference,  <= 0.6 x Liger,  <= 0.5 x TRL
    peak  <= 0.3 x reference,   <= 0.6 x Liger         (stretch: inputs + gradients + 15% above the runtime)

and for the preference and distillation workloads their own (`WORKLOAD_GOALS`): dpo, orpo time <= 0.6 x
Liger's chunked loss at peak <= 1.0 x Liger's; jsd time <= 0.6 x Liger's and <= 0.6 x TRL's.

Plots draw each implementation in one colour everywhere (`colour`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ludic_fast.benchmark.impls import FLOOR, IMPLS
from ludic_fast.benchmark.runner import CaseResult
from ludic_fast.benchmark.workloads import WORKLOADS, Shape

TIME_GOALS = {FLOOR: 1.0, "reference": 0.75, "liger": 0.6, "trl": 0.5}
MEMORY_GOALS = {"reference": 0.3, "liger": 0.6}
#: workloads whose goals replace TIME_GOALS / MEMORY_GOALS: (time goals, memory goals)
WORKLOAD_GOALS = {
    "dpo": ({"liger": 0.6}, {"liger": 1.0}),
    "orpo": ({"liger": 0.6}, {"liger": 1.0}),
    "jsd": ({"liger": 0.6, "trl": 0.6}, {}),
}
GOAL_MODE = "ours-fused"
#: (N, D, V, dtype) where the goals are stated; elsewhere the ratios are shown without a verdict
GOAL_SHAPES = {(2048, 896, 151936, "float32")}
STRETCH_FACTOR = 1.15
_GIB = 2**30
#: tab20 colours in a fixed order: one colour per implementation in every plot
_PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
    "#dbdb8d",
    "#9edae5",
]


def colour(impl: str) -> str:
    """The plot colour of an implementation: fixed by its place in `IMPLS` (names no longer registered,
    from older results files, share a neutral grey)."""
    names = list(IMPLS)
    return _PALETTE[names.index(impl) % len(_PALETTE)] if impl in IMPLS else "#4d4d4d"


def goals_apply(shape: Shape) -> bool:
    """Whether the project's goals are stated for this shape (in its default layout, not `same_rows`)."""
    return (shape.n_tokens, shape.d, shape.v, shape.dtype) in GOAL_SHAPES and not shape.same_rows


def scored_rows(r: CaseResult) -> int:
    """Rows the workload needs scored (the µs/row denominator, the same for every implementation)."""
    return WORKLOADS[r.workload].scored_rows(r.shape) if r.workload in WORKLOADS else r.shape.n_tokens


def rows_computed(r: CaseResult) -> int:
    """Rows this implementation pushes through the head."""
    if r.impl in IMPLS and r.workload in WORKLOADS:
        return IMPLS[r.impl].rows_computed(WORKLOADS[r.workload], r.shape)
    return r.shape.n_tokens


def us_per_row(r: CaseResult) -> float | None:
    return None if r.median_s is None else r.median_s * 1e6 / max(1, scored_rows(r))


def extra_bytes(r: CaseResult) -> int | None:
    """Peak memory over what was allocated when the inputs were ready (CUDA: the inputs themselves)."""
    return None if r.peak_bytes is None or r.base_bytes is None else r.peak_bytes - r.base_bytes


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if (a is None or b is None or b == 0) else a / b


def groups(results: Iterable[CaseResult]) -> dict[tuple[Shape, str], dict[str, CaseResult]]:
    """Results keyed by (shape, workload), then implementation name, in run order."""
    out: dict[tuple[Shape, str], dict[str, CaseResult]] = {}
    for r in results:
        out.setdefault((r.shape, r.workload), {})[r.impl] = r
    return out


def _ok(group: dict[str, CaseResult], name: str) -> CaseResult | None:
    r = group.get(name)
    return r if (r is not None and r.status == "ok") else None


def useful_flops(r: CaseResult) -> float:
    """The matmul work a step needs on the scored rows N (6NDV for forward+backward, 2NDV for the forward
    GEMM alone); a backward that recomputes the logits does 8NDV in the same time, so its rate reads lower."""
    ndv = IMPLS[r.impl].useful_ndv if r.impl in IMPLS else 6
    return ndv * float(scored_rows(r) * r.shape.d * r.shape.v)


def io_bytes(shape: Shape) -> int:
    """Bytes of the inputs (hidden [N, D], weight [V, D]) plus their gradients, in the shape's dtype."""
    elem = 2 if shape.dtype in ("bfloat16", "float16") else 4
    return 2 * elem * (shape.n_tokens * shape.d + shape.v * shape.d)


def above_runtime(r: CaseResult) -> float | None:
    """Peak bytes above the bare runtime: peak - (RSS when the inputs were ready) + input bytes."""
    if r.peak_bytes is None or r.base_bytes is None:
        return None
    return r.peak_bytes - r.base_bytes + io_bytes(r.shape) / 2


def transient_bytes(r: CaseResult) -> float | None:
    """Peak bytes beyond the runtime, the inputs and their gradients: logits, workspaces, accumulators."""
    above = above_runtime(r)
    return None if above is None else above - io_bytes(r.shape)


def results_table(group: dict[str, CaseResult]) -> str:
    """One markdown table: every implementation of one (shape, workload)."""
    ref, floor = _ok(group, "reference"), _ok(group, FLOOR)
    header = (
        "| implementation | rows | median s | min s | µs/row | useful TFLOP/s | peak GiB | extra GiB "
        "| above runtime GiB | time × ref | time × GEMMs | peak × ref | err logprob | err entropy | err loss "
        "| err dh (rel) | err dW (rel) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    not_run = [f"{name} ({r.status}: {r.reason})" for name, r in group.items() if r.status != "ok"]
    for name, r in group.items():
        if r.status != "ok":
            continue
        e = r.errors
        extra = extra_bytes(r)
        cells = [
            name,
            str(rows_computed(r)),
            _fmt(r.median_s),
            _fmt(r.min_s),
            _fmt(us_per_row(r), ".3g"),
            _fmt(useful_flops(r) / r.median_s / 1e12, ".3g"),
            _fmt(r.peak_bytes / _GIB, ".2f"),
            _fmt(None if extra is None else extra / _GIB, ".2f"),
            _fmt(None if above_runtime(r) is None else above_runtime(r) / _GIB, ".2f"),
            _fmt(_ratio(r.median_s, ref and ref.median_s), ".2f"),
            _fmt(_ratio(r.median_s, floor and floor.median_s), ".2f"),
            _fmt(_ratio(r.peak_bytes, ref and ref.peak_bytes), ".2f"),
            _fmt(e.get("logprobs"), ".1e"),
            _fmt(e.get("entropy"), ".1e"),
            _fmt(e.get("loss"), ".1e"),
            _fmt(e.get("grad_hidden_rel"), ".1e"),
            _fmt(e.get("grad_weight_rel"), ".1e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if not_run:
        lines += ["", "Not run: " + "; ".join(not_run) + "."]
    return "\n".join(lines)


def _verdict(value: float | None, goal: float | None) -> str:
    if goal is None or value is None:
        return ""
    return "met" if value <= goal else f"missed by {value / goal:.2f}×"


def _goal_cell(value: float | None, goal: float | None) -> str:
    return "" if goal is None or value is None else f"≤ {goal:g}: {_verdict(value, goal)}"


def ours_table(group: dict[str, CaseResult]) -> str:
    """Every ratio of each of our modes against every other implementation that ran."""
    header = "| ours | vs | time ratio | time goal | peak ratio | peak goal |"
    lines = [header, "|---|---|---|---|---|---|"]
    others = [n for n, r in group.items() if r.status == "ok" and r.role != "ours" and n != "gemm-fwd"]
    for name, r in group.items():
        if r.role != "ours" or r.status != "ok":
            continue
        goals = name == GOAL_MODE and goals_apply(r.shape)
        time_goals, memory_goals = WORKLOAD_GOALS.get(r.workload, (TIME_GOALS, MEMORY_GOALS))
        for other in others:
            o = group[other]
            t, m = _ratio(r.median_s, o.median_s), _ratio(r.peak_bytes, o.peak_bytes)
            tg = time_goals.get(other) if goals else None
            mg = memory_goals.get(other) if goals else None
            lines.append(
                f"| {name} | {other} | {_fmt(t, '.2f')} | {_goal_cell(t, tg)} | {_fmt(m, '.2f')} "
                f"| {_goal_cell(m, mg)} |"
            )
        if goals and r.workload not in WORKLOAD_GOALS:
            above = above_runtime(r)
            bound = STRETCH_FACTOR * io_bytes(r.shape)
            above_gib = _fmt(None if above is None else above / _GIB, ".2f")
            lines.append(
                f"| {name} | stretch: inputs + grads + 15% = {bound / _GIB:.2f} GiB | | "
                f"| {above_gib} GiB above runtime | {_verdict(above, bound)} |"
            )
    return "\n".join(lines)


def markdown_report(results: list[CaseResult], meta: dict[str, str]) -> str:
    """The whole report: run metadata, then per shape and workload the results and ratio tables."""
    lines = ["# ludic_fast benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        "Times are forward+backward of one step (median and min of the timed runs after warm-up; CUDA events",
        "on a GPU). Peak = process peak RSS (CPU, each implementation in its own process) / max_memory_allocated",
        "(CUDA) from the moment the inputs were built; *extra* = peak minus what was allocated then (on CUDA",
        "the inputs: extra is the gradients and every transient); *above runtime* = peak minus the process's",
        "RSS before the inputs, plus the inputs. *rows* = rows the implementation pushes through the head: an",
        "RL workload needs only its action rows scored (ours and TRL score those; Liger's GRPO loss takes the",
        "[B, T−1] batch and scores every position; the reference materialises all B·T logits rows); µs/row",
        "divides by the rows the workload needs, the same for every implementation.",
        "Errors are max |x − float64 reference| on a sub-sample (gradients relative to max |reference|).",
        "GEMMs = the three bare GEMMs of the scored rows (z = hWᵀ, dh = zW, dW = zᵀh: 6NDV), the physical",
        "floor. Useful TFLOP/s counts 6NDV per fwd+bwd step over the scored rows (2NDV for gemm-fwd); a",
        "backward that recomputes logits does 8NDV then. Goal verdicts appear only at the shapes the goals",
        "are stated for (" + ", ".join(f"N={n} D={d} V={v} {dt}" for n, d, v, dt in sorted(GOAL_SHAPES)) + "),",
        "not in a *same rows* run (a one-token prompt: every implementation scores all positions after the first).",
    ]
    for (shape, workload), group in groups(results).items():
        lines += ["", f"## {workload} — {shape.label()}", "", results_table(group), "", ours_table(group)]
    lines.append("")
    return "\n".join(lines)


def plot_scaling(results: list[CaseResult], workload: str, axis: str, path: str | Path) -> bool:
    """PNG of median time and transient memory (`transient_bytes`: the peak beyond the runtime, the
    inputs and their gradients) against N (`axis='n'`) or V (`axis='v'`) for one workload, one line per
    implementation (other shape fields fixed at their most common value). False when matplotlib is
    missing or fewer than two points vary."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results if r.workload == workload and r.status == "ok"]
    key = (lambda s: s.n_tokens) if axis == "n" else (lambda s: s.v)
    fixed = _most_common([(s.d, s.v if axis == "n" else s.n_tokens, s.dtype) for s in (r.shape for r in rows)])
    rows = [r for r in rows if (r.shape.d, r.shape.v if axis == "n" else r.shape.n_tokens, r.shape.dtype) == fixed]
    if len({key(r.shape) for r in rows}) < 2:
        return False
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in [*IMPLS, *sorted({r.impl for r in rows} - set(IMPLS))]:
        pts = sorted((key(r.shape), r.median_s, transient_bytes(r) / _GIB) for r in rows if r.impl == name)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        style = "--" if name in IMPLS and IMPLS[name].role == "floor" else "-"
        ax_t.plot(xs, [p[1] for p in pts], style, marker="o", label=name, color=colour(name))
        ax_m.plot(xs, [p[2] for p in pts], style, marker="o", label=name, color=colour(name))
    label = "N (tokens)" if axis == "n" else "V (vocabulary)"
    other = f"D={fixed[0]} {'V' if axis == 'n' else 'N'}={fixed[1]} {fixed[2]}"
    ax_t.set(xlabel=label, ylabel="fwd+bwd time, s (median)", title=f"{workload}: time ({other})")
    ax_m.set(
        xlabel=label,
        ylabel="peak beyond runtime, inputs and gradients, GiB",
        title=f"{workload}: transient memory ({other})",
    )
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
    ax_m.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _most_common(items: list[tuple]) -> tuple | None:
    return max(set(items), key=items.count) if items else None


def summary_table(results: list[CaseResult]) -> str:
    """The key table printed at the end of a run: per (workload, shape) every implementation's median
    time, µs per scored row, extra memory over the inputs (the gradients included) and its transient part
    (`transient_bytes`: without the gradients), or why it did not run."""
    lines = [
        "| workload | shape | implementation | median ms | µs/row | extra GiB | transient GiB | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (shape, workload), group in groups(results).items():
        for name, r in group.items():
            extra, transient = extra_bytes(r), transient_bytes(r)
            status = "ok" if r.status == "ok" else f"{r.status}: {r.reason}"
            lines.append(
                f"| {workload} | {shape.label()} | {name} | {_fmt(r.median_s and r.median_s * 1e3, '.2f')} "
                f"| {_fmt(us_per_row(r), '.3g')} | {_fmt(None if extra is None else extra / _GIB, '.2f')} "
                f"| {_fmt(None if transient is None else transient / _GIB, '.2f')} | {status} |"
            )
    return "\n".join(lines)
