"""Cross-rank reduction of a training step's stats, with Ludic's rule (`_maybe_reduce_stats_across_ranks`).

For the numeric stats of one step on R ranks (keys sorted; non-numeric values pass through):

    gpu_*                                                     max_r v_r
    num_samples, target_rollouts, effective_rollouts,
    total_completion_tokens                                   sum_r v_r
    train_step                                                this rank's value (not reduced)
    every other key                                           sum_r v_r n_r / sum_r n_r,  n_r = num_samples_r
                                                              (the plain mean over ranks without num_samples)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

SUM_KEYS = frozenset({"num_samples", "target_rollouts", "effective_rollouts", "total_completion_tokens"})
LOCAL_KEYS = frozenset({"train_step"})


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, Tensor) and v.numel() == 1 and v.dtype != torch.bool and not v.dtype.is_complex:
        return float(v.detach().reshape(()).item())
    return None


def collective_device(group) -> torch.device:
    """Where a collective's tensors live for `group`: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_stats_across_ranks(stats: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Ludic's cross-rank reduction of `stats` (see the module docstring); a no-op copy when
    torch.distributed is not initialized. Collective: every rank calls it with the same numeric keys (a
    mismatch raises ValueError on every rank rather than reducing unrelated values)."""
    out = dict(stats)
    if not (dist.is_available() and dist.is_initialized()):
        return out
    numeric = {k: x for k in sorted(stats) if k not in LOCAL_KEYS and (x := _number(stats[k])) is not None}
    dev = collective_device(group)
    digest = int.from_bytes(hashlib.sha256("\0".join(numeric).encode()).digest()[:6], "big")  # exact in float64
    check = torch.tensor([digest, -digest], dtype=torch.float64, device=dev)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    if int(check[0]) != digest or int(-check[1]) != digest:
        raise ValueError("stats: ranks report different numeric stat keys; cannot reduce them across ranks")
    max_keys = [k for k in numeric if k.startswith("gpu_")]
    sum_keys = [k for k in numeric if k in SUM_KEYS]
    mean_keys = [k for k in numeric if k not in SUM_KEYS and not k.startswith("gpu_")]
    n = numeric.get("num_samples", 1.0)
    sums = torch.tensor(
        [numeric[k] for k in sum_keys] + [numeric[k] * n for k in mean_keys] + [n], dtype=torch.float64, device=dev
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    total_n = float(sums[-1])
    for i, k in enumerate(sum_keys):
        out[k] = float(sums[i])
    for i, k in enumerate(mean_keys):
        out[k] = float(sums[len(sum_keys) + i]) / total_n if total_n else 0.0
    if max_keys:
        maxes = torch.tensor([numeric[k] for k in max_keys], dtype=torch.float64, device=dev)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        out.update({k: float(v) for k, v in zip(max_keys, maxes.tolist())})
    return out
