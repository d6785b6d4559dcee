"""Warnings for training steps that cannot learn, each said once per run.

`LearningSignalMonitor` is a train logger (`log(step, stats)`, Ludic's protocol) that reads the logged
stats and calls `notify(message)` the first time a step
- has every group's rewards tied (`train/zero_variance_group_frac == 1`): group-relative advantages
  r_i - mean(r) are all 0, so the policy-gradient term vanishes;
- has credit 0 on every item (`train/zero_weight_frac == 1`);
- trains on no sample at all (`train/num_samples == 0`), or had to skip batches whose samples were all
  filtered out (`train/empty_batches > 0`);
- has a gradient norm of exactly 0 (the step left the weights unchanged).
`warn(kind, message)` sends a warning known before training (e.g. a group size of 1) through the same
once-per-kind channel. `console_notifier(console)` routes messages to a console logger's `warn` (the rich
dashboard's warnings panel, or a PrintLogger line) and to stderr when there is none.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any


def console_notifier(console: Any) -> Callable[[str], None]:
    """`console.warn(message)` when the console logger has it, else a line on stderr."""
    warn = getattr(console, "warn", None)
    if callable(warn):
        return warn
    return lambda message: print(f"WARNING: {message}", file=sys.stderr, flush=True)


class LearningSignalMonitor:
    """Train logger that warns once per kind when a step cannot learn (module docstring)."""

    def __init__(self, notify: Callable[[str], None]):
        self.notify = notify
        self.said: set[str] = set()

    def warn(self, kind: str, message: str) -> None:
        """Send `message` unless a warning of `kind` was already sent."""
        if kind not in self.said:
            self.said.add(kind)
            self.notify(message)

    def log(self, step: int, stats: Mapping[str, Any]) -> None:
        if stats.get("train/num_samples") == 0:
            self.warn("no_samples", f"step {step} trained on no sample: every rollout was filtered out")
        empty = stats.get("train/empty_batches")
        if isinstance(empty, (int, float)) and empty > 0:
            self.warn(
                "empty_batches",
                f"step {step}: {empty:.0f} batch(es) skipped because every sample was filtered out "
                "(--max-lag or the preset's filters)",
            )
        if stats.get("train/zero_variance_group_frac") == 1.0:
            reward = stats.get("train/avg_total_reward")
            tied = f" (mean reward {reward:.3g})" if isinstance(reward, (int, float)) else ""
            self.warn(
                "zero_variance",
                f"step {step}: every group's rewards tie{tied}, so group-relative advantages are 0 and the "
                "step cannot learn; use more samples per group (--group-size), a higher --temperature, "
                "a graded reward, or --tie-jitter",
            )
        elif stats.get("train/zero_weight_frac") == 1.0:
            self.warn("zero_weight", f"step {step}: every sample has advantage 0, so the step cannot learn")
        if stats.get("train/grad_norm") == 0.0:
            self.warn("zero_grad", f"step {step}: the gradient is exactly 0; the step left the weights unchanged")


__all__ = ["LearningSignalMonitor", "console_notifier"]
