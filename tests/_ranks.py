"""Comparing the parameters of a run on several ranks with a one-process run (tests/test_cli_parallel.py,
tests/test_pipeline_torchrun.py)."""

from __future__ import annotations

import torch


def assert_same_params(wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor], *, lr: float, steps: int) -> None:
    """The two runs' parameters agree to fp32 summation order. AdamW's per-element step m / (sqrt(v) + eps) turns
    the reordered sums of a rank's gradient all-reduce into an update difference of up to lr where |g| is near
    eps, so: every element within 10% of lr x steps, and 99.9% of them within 1e-6 + 1e-4 |w| (a wrong share
    of the data moves most elements by ~lr)."""
    assert wa.keys() == wb.keys()
    diffs = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    scale = torch.cat([wb[k].abs().flatten() for k in wa])
    assert float(diffs.max()) <= 0.1 * lr * steps, float(diffs.max())
    close = float((diffs <= 1e-6 + 1e-4 * scale).float().mean())
    assert close >= 0.999, close
