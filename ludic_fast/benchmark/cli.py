"""`ludic-fast bench`: time and memory of the head and losses, ours vs reference vs peers vs the GEMM floor.

    ludic-fast bench --preset key --out bench/results          # the key CPU table (N=2048, Qwen2.5-0.5B head)
    ludic-fast bench --preset cpu --out bench/results          # + N sweep, V sweep, D=2048 V=32000, head/SFT/RL
    ludic-fast bench --preset preference --device cpu          # dpo, orpo, jsd at N=2048 D=896 V=151936, CPU
    ludic-fast bench --preset preference --device cpu --same-rows  # every impl scores the same rows (-> .../same-rows)
    ludic-fast bench --preset gpu-key                          # GPU: the anchor shape (-> bench/results/gpu/key)
    ludic-fast bench --preset gpu                              # GPU: six shapes, head + CISPO + SFT (-> .../gpu/full)
    ludic-fast bench --workloads head,cispo --n 512,1024 --d 896 --v 151936 --impls ours-fused,reference
    ludic-fast bench --render bench/results/results.json --out bench/results  # redraw tables and plots

Writes `results.json`, `results.md` (tables with every ratio) and `scaling_<workload>_<n|v>.png` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ludic_fast.benchmark.impls import IMPLS
from ludic_fast.benchmark.report import markdown_report, plot_scaling, summary_table
from ludic_fast.benchmark.runner import BenchStopped, CaseResult, Options, run_suite, signals_held, stop_on_signals
from ludic_fast.benchmark.workloads import WORKLOADS, Shape
from ludic_fast.cli.validation import OneLineParser, UsageError, check_device, check_file, check_output_dir
from ludic_fast.run.atomic_io import atomic_write_text

QWEN_D, QWEN_V = 896, 151936  # Qwen2.5-0.5B head
_CPU_IMPLS = ("ours-fused", "ours-generic", "reference", "liger", "trl", "verl", "gemm-fwd+bwd", "gemm-fwd")
#: the GPU presets' implementations, in the order measured: what decides the goals first (ours, TRL, the floor,
#: Liger), the experimental TMA variants last
_GPU_IMPLS = (
    "ours-fused",
    "ours-generic",
    "trl",
    "gemm-fwd+bwd",
    "ours-generic-held",
    "liger",
    "ours-triton-workspace",
    "ours-fused-workspace",
    "ours-triton-fused",
    "ours-fused-tl-dot",
    "ours-torch",
    "reference",
    "verl",
    "torch-lce",
    "cce",
    "gemm-fwd",
    "ours-triton-fused-tma",
    "ours-fused-tl-dot-tma",
)
#: the head op, SFT and the RL losses (the preference and distillation workloads have their own preset)
_RL_WORKLOADS = tuple(name for name, w in WORKLOADS.items() if w.kind in ("head", "ce", "rl"))
#: (N, D, V): the anchor (Qwen2.5-7B-like head), Qwen2.5-0.5B's head at 16k tokens, Llama-3-8B's at 32k,
#: and the anchor's D, V at small N (where one token tile decides the strategy)
GPU_ANCHOR = (8192, 4096, 151936)
_GPU_SHAPES = [GPU_ANCHOR, (16384, 896, 151936), (32768, 4096, 128256)] + [(n, 4096, 151936) for n in (64, 512, 2048)]
#: the GPU presets: CUDA events, median of 5 after 2 warm-ups, every case in one process
_GPU_RUNS = {"dtype": "bfloat16", "one_process": True, "warmup": 2, "repeats": 5}

PRESETS: dict[str, dict] = {
    "key": {
        "shapes": [(2048, QWEN_D, QWEN_V)],
        "workloads": ("head", "cispo"),
        "impls": _CPU_IMPLS,
        "dtype": "float32",
    },
    "cpu": {
        "shapes": [(n, QWEN_D, QWEN_V) for n in (512, 1024, 2048, 4096)]
        + [(1024, QWEN_D, v) for v in (32000, 65536)]
        + [(2048, 2048, 32000)],
        "workloads": _RL_WORKLOADS,
        "impls": _CPU_IMPLS,
        "dtype": "float32",
    },
    "preference": {
        "shapes": [(2048, QWEN_D, QWEN_V)],
        "workloads": ("dpo", "orpo", "jsd"),
        "impls": ("ours-fused", "ours-generic", "reference", "liger", "trl", "gemm-fwd+bwd"),
        "dtype": "float32",
        "out": "bench/results/preference",
    },
    "gpu": {
        "shapes": _GPU_SHAPES,
        "workloads": ("head", "cispo", "sft"),
        "impls": _GPU_IMPLS,
        "out": "bench/results/gpu/full",
        **_GPU_RUNS,
    },
    "gpu-key": {
        "shapes": [GPU_ANCHOR],
        "workloads": ("head", "cispo", "sft"),
        "impls": _GPU_IMPLS,
        "out": "bench/results/gpu/key",
        **_GPU_RUNS,
    },
    "smoke": {
        "shapes": [(64, 32, 1021), (128, 32, 1021)],
        "workloads": ("head", "cispo"),
        "impls": _CPU_IMPLS,
        "dtype": "float32",
    },
}


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return items


def _names(known: Mapping[str, object], what: str) -> Callable[[str], list[str]]:
    """argparse type: a comma list of keys of `known`."""

    def parse(text: str) -> list[str]:
        names = _csv(text)
        bad = [n for n in names if n not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(sorted(known))}")
        return names

    return parse


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_count = _int_at_least(1)


def _counts(text: str) -> list[int]:
    return [_count(t) for t in _csv(text)]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _triples(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in _csv(text):
        parts = item.lower().split("x")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"{item!r} is not NxDxV (e.g. 8192x4096x151936)")
        n, d, v = (_count(x) for x in parts)
        out.append((n, d, v))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="ludic-fast bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="shapes/workloads/implementations to start from")
    p.add_argument("--workloads", type=_names(WORKLOADS, "workload"), help=f"comma list of {sorted(WORKLOADS)}")
    p.add_argument("--impls", type=_names(IMPLS, "implementation"), help=f"comma list of {sorted(IMPLS)}")
    p.add_argument("--shapes", type=_triples, help="comma list of NxDxV shapes (instead of the preset's)")
    p.add_argument("--n", type=_counts, help="comma list of token counts N (with --d and --v: their product)")
    p.add_argument("--d", type=_counts, help="comma list of hidden sizes D")
    p.add_argument("--v", type=_counts, help="comma list of vocabulary sizes V")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seq-len", type=_count, default=512, help="tokens per sequence of the loss batches")
    p.add_argument(
        "--same-rows",
        action="store_true",
        help="loss batches with a one-token prompt: every implementation scores the same rows (all "
        "positions after the first, as Liger's [B, T] losses do) instead of ours and TRL the "
        "completion rows only; the output goes to a same-rows/ subfolder, without goal verdicts",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=_count, default=2, help="torch threads per case (CPU)")
    p.add_argument("--repeats", type=_count, default=None, help="timed runs per case (default: the preset's, else 3)")
    p.add_argument(
        "--warmup", type=_int_at_least(0), default=None, help="untimed runs before timing (default: preset's, else 1)"
    )
    p.add_argument(
        "--one-process",
        action="store_true",
        default=None,
        help="measure every case in this process (CUDA: the allocator peak is reset per case; the GPU "
        "presets' default); otherwise one process per case",
    )
    p.add_argument(
        "--check-tokens", type=_int_at_least(0), default=256, help="tokens of the float64 error check (0: none)"
    )
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--timeout", type=_seconds, default=3600.0, help="seconds per case")
    p.add_argument("--out", default=None, help="output folder (default: the preset's, else bench/results)")
    p.add_argument("--note", action="append", default=[], help="free-form line for the report header")
    p.add_argument("--render", metavar="RESULTS_JSON", help="only re-render tables and plots of a results.json")
    return p


def _shapes(args: argparse.Namespace, preset: dict) -> list[Shape]:
    dtype = args.dtype or preset.get("dtype", "float32")
    if args.shapes:
        triples = args.shapes
    elif args.n or args.d or args.v:
        ns, ds, vs = args.n or [2048], args.d or [QWEN_D], args.v or [QWEN_V]
        triples = [(n, d, v) for d in ds for v in vs for n in ns]
    else:
        triples = preset.get("shapes", [(2048, QWEN_D, QWEN_V)])
    try:
        return [Shape(n, d, v, dtype=dtype, seq_len=args.seq_len, same_rows=args.same_rows) for n, d, v in triples]
    except ValueError as exc:  # e.g. sequences of one token
        raise UsageError(f"--shapes/--n/--seq-len: {exc}") from None


def _flags_given(args: argparse.Namespace) -> list[str]:
    """The flags whose value differs from the parser's default."""
    defaults = vars(build_parser().parse_args([]))
    return ["--" + k.replace("_", "-") for k, v in vars(args).items() if v != defaults[k]]


def _render_inputs(args: argparse.Namespace) -> tuple[list[CaseResult], dict[str, str], Path]:
    """--render's results and output folder, checked before anything is drawn."""
    ignored = [f for f in _flags_given(args) if f not in ("--render", "--out")]
    if ignored:
        raise UsageError(f"--render redraws a results.json and takes only --out; {ignored[0]} does not apply")
    check_file(args.render, "--render")
    try:
        results, meta = load_results(args.render)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"--render {args.render}: not a results.json of ludic-fast bench ({reason})") from None
    return results, meta, check_output_dir(args.out or Path(args.render).parent, "--out")


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # called through `ludic-fast bench ...`
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.render:
        try:
            results, meta, out = _render_inputs(args)
        except UsageError as exc:
            parser.error(str(exc))
        write_outputs(results, meta, out)
        print(f"wrote {out}/results.md")
        return 0
    preset = PRESETS.get(args.preset or "key")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    workloads = args.workloads or list(preset["workloads"])
    impls = args.impls or list(preset["impls"])
    try:
        check_device(device)
        shapes = _shapes(args, preset)
        out = check_output_dir(
            args.out or Path(preset.get("out", "bench/results"), "same-rows" if args.same_rows else ""), "--out"
        )
    except UsageError as exc:
        parser.error(str(exc))
    warmup = args.warmup if args.warmup is not None else preset.get("warmup", 1)
    repeats = args.repeats if args.repeats is not None else preset.get("repeats", 3)
    one_process = bool(args.one_process if args.one_process is not None else preset.get("one_process", False))
    opts = Options(
        device=device,
        threads=args.threads,
        repeats=repeats,
        warmup=warmup,
        check_tokens=args.check_tokens,
        seed=args.seed,
        timeout_s=args.timeout,
        in_process=one_process,
    )
    started = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "command": "ludic-fast bench " + " ".join(argv),
        "date (UTC)": started.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, device {device}",
        **device_info(device),
        "torch threads": str(args.threads),
        "versions": versions(),
        "runs": f"{warmup} warm-up + {repeats} timed per case"
        + (", CUDA events" if device.startswith("cuda") else "")
        + (", every case in one process" if one_process else ", each case in its own process"),
        "load average (1/5/15 min) before": _load_average(),
        **{f"note {i + 1}": n for i, n in enumerate(args.note)},
    }
    total = len(shapes) * len(workloads) * len(impls)

    saved: list[int] = [0]

    def save_so_far(done: list[CaseResult]) -> None:  # a run stopped midway keeps its tables, written whole
        with signals_held():
            write_tables(done, {**meta, "status": f"incomplete: {len(done)} of {total} cases (the run stopped)"}, out)
            saved[0] = len(done)

    try:
        with stop_on_signals():
            results = run_suite(impls, workloads, shapes, opts, on_result=save_so_far)
    except BenchStopped as stop:  # the cases measured so far are in the tables (save_so_far after each case)
        kept = f"{saved[0]} of {total} cases kept in {out}/results.md" if saved[0] else "no case was finished"
        print(f"ludic-fast bench: stopped by {stop.name}: {kept}", file=sys.stderr)
        return 128 + stop.signum
    meta["load average after"] = _load_average()
    write_outputs(results, meta, out)
    print(summary_table(results))
    print(f"wrote {out}/results.md")
    # a peer or the reference failing (out of memory, a compile error) is a result; ours or a floor failing is not
    return 0 if all(r.status != "failed" or IMPLS[r.impl].role in ("peer", "reference") for r in results) else 1


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's "model name") and architecture."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    return platform.processor() or platform.machine()


def versions() -> str:
    """python, torch, triton and every installed peer, as 'name version' pairs."""
    names = ("torch", "triton", "transformers", "liger-kernel", "trl", "verl", "cut-cross-entropy")
    found = [f"python {platform.python_version()}"] + [f"{n} {v}" for n in names if (v := _version(n))]
    return ", ".join(found)


def device_info(device: str) -> dict[str, str]:
    """The card, its driver and the CUDA runtime torch was built with (empty off CUDA)."""
    if not device.startswith("cuda"):
        return {}
    props = torch.cuda.get_device_properties(torch.device(device))
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        driver = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        driver = "unknown (no nvidia-smi)"
    return {
        "card": f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs",
        "driver": driver,
        "CUDA (torch build)": str(torch.version.cuda),
    }


def write_tables(results: list[CaseResult], meta: dict[str, str], out: Path) -> None:
    """results.json and results.md, each replaced atomically (a reader sees the old or the whole new file)."""
    payload = {"meta": meta, "results": [r.to_json() for r in results]}
    atomic_write_text(out / "results.json", json.dumps(payload, indent=1) + "\n")
    atomic_write_text(out / "results.md", markdown_report(results, meta))


def write_outputs(results: list[CaseResult], meta: dict[str, str], out: Path) -> None:
    """results.json, results.md and the scaling plots of every workload with a sweep along N or V."""
    write_tables(results, meta, out)
    for workload in dict.fromkeys(r.workload for r in results):
        for axis in ("n", "v"):
            plot_scaling(results, workload, axis, out / f"scaling_{workload}_{axis}.png")


def load_results(path: str | Path) -> tuple[list[CaseResult], dict[str, str]]:
    """Read back a results.json written by `write_outputs`."""
    payload = json.loads(Path(path).read_text())
    return [CaseResult.from_json(r) for r in payload["results"]], payload["meta"]


__all__ = ["main", "build_parser", "write_outputs", "write_tables", "load_results", "PRESETS"]
