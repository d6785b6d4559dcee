"""The learning-rate schedule: linear warm-up over `warmup_steps`, then constant, linear or cosine decay to 0
at `total_steps` (`EngineConfig.lr_scheduler`). Optimizer step s (from 0) runs at lr · lr_lambda(cfg)(s)."""

from __future__ import annotations

import math
from collections.abc import Callable

from ludic_fast.engine.config import EngineConfig


def lr_lambda(cfg: EngineConfig) -> Callable[[int], float]:
    """LR multiplier at optimizer step s: s/warmup during warm-up, then 1 | linear to 0 | cosine to 0."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler == "constant":
            return 1.0
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.lr_scheduler == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor



__all__ = ["lr_lambda"]
