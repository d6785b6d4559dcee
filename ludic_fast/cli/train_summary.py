"""`ludic-fast train`'s summary: summary.json (the RL reward curve, the means of its first and last 10 steps
and their gain), curves.png, and the run's last line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from ludic_fast.run.loggers import plot_curves, read_jsonl
from ludic_fast.trainer import Trainer


def summarize(records: list[dict[str, Any]], key: str = "train/avg_total_reward", n: int = 10) -> dict[str, Any]:
    """RL reward curve: the values, the means of the first and last n steps and their difference. With
    fewer than 2n steps the two windows overlap and measure nothing: means and gain are then None."""
    curve = [r[key] for r in records if r.get("phase") == "rl" and isinstance(r.get(key), (int, float))]
    out: dict[str, Any] = {"reward_curve": curve, f"first{n}_mean": None, f"last{n}_mean": None, "gain": None}
    if len(curve) >= 2 * n:
        first, last = sum(curve[:n]) / n, sum(curve[-n:]) / n
        out.update({f"first{n}_mean": first, f"last{n}_mean": last, "gain": last - first})
    return out


def summary_line(summary: dict[str, Any], n: int = 10) -> str:
    """The run's last line: the reward gain, or why there is none; wall time; the curves' PNG."""
    curve = summary["reward_curve"]
    if not curve:
        reward = "RL reward: no RL steps ran"
    elif summary["gain"] is None:
        mean = sum(curve) / len(curve)
        reward = (
            f"RL reward: mean {mean:.3f} over {len(curve)} steps; not enough steps to measure a gain "
            f"(needs {2 * n}: first-{n} vs last-{n} mean)"
        )
    else:
        reward = (
            f"RL reward: first-{n} mean {summary[f'first{n}_mean']:.3f}, last-{n} mean "
            f"{summary[f'last{n}_mean']:.3f} (gain {summary['gain']:+.3f})"
        )
    return f"{reward}; {summary['wall_time_s']:.3g} s; curves: {summary.get('png', '-')}"



def write_summary(args: argparse.Namespace, command: str, out: Path, t0: float, rl: Trainer | None) -> dict[str, Any]:
    """summary.json and curves.png from metrics.jsonl (the records written so far)."""
    metrics = out / "metrics.jsonl"
    records = read_jsonl(metrics) if metrics.exists() else []
    summary = summarize(records)
    summary.update(
        wall_time_s=time.perf_counter() - t0,
        rl_steps=0 if rl is None else rl.step_idx,
        skipped_steps=0 if rl is None else rl.skipped_steps,
        metrics=str(metrics),
    )
    if not args.no_plot:
        if importlib.util.find_spec("matplotlib") is None:
            print("curves.png skipped: matplotlib is not installed (pip install 'ludic-fast[plot]')", file=sys.stderr)
        else:
            png = plot_curves(records, out / "curves.png", title=f"ludic-fast {command}: {args.preset}")
            summary["png"] = str(png)
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary

