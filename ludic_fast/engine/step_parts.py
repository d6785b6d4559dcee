"""The engine step's device-side parts that decide its speed on a GPU: the AdamW implementation, the gradient
norm and clipping, and the one host read of the step's values.

- `make_adamw`: torch's AdamW, `fused=True` when every parameter is a plain floating tensor on the CPU or a
  CUDA device (one kernel per dtype group instead of a dozen multi-tensor launches on CUDA, a vectorised
  pass on the CPU, where torch's default is the per-parameter loop), torch's default otherwise (DTensor
  parameters); the update `m <- b1 m + (1 - b1) g`, `v <- b2 v + (1 - b2) g^2`,
  `p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`, the same to rounding (fp32 arithmetic in one pass).
- `grad_norm_and_clip`: the total 2-norm of the gradients, `||g||`, and `g <- g min(1, c / (||g|| + 1e-6))`
  with multi-tensor kernels; without a bound (c = None) only the norm (torch's clip would multiply every
  gradient by 1).
- `read_step_values`: the step's loss, gradient norm, token counts and every one-element tensor among the
  micro-batch stats, copied to the host in one transfer — the one host-device synchronisation of a step's own
  code (`engine.host_syncs` counts them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn


def make_adamw(params: Sequence[Tensor], *, lr: float, weight_decay: float, betas: tuple[float, float],
               eps: float) -> torch.optim.AdamW:
    """AdamW over `params`, fused where torch has the kernel for every parameter (module docstring)."""
    fused = bool(params) and all(
        type(p) in (Tensor, nn.Parameter) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
        for p in params
    )
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused or None)


def grad_norm_and_clip(params: Sequence[Tensor], max_norm: float | None) -> Tensor:
    """The gradients' total 2-norm (a 0-d tensor on their device, before clipping); clips them to `max_norm`
    unless it is None."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm is None:
        if not grads:
            return torch.zeros(())
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def non_pad_tokens(batch: Mapping[str, Tensor]) -> Tensor:
    """The tokens of a collated micro-batch without its padding, as a 0-d tensor: packed, the sum of its
    sequence lengths (the last offset); padded, the sum of its attention mask."""
    if "cu_seqlens" in batch:
        return batch["cu_seqlens"][-1]
    return batch["attention_mask"].sum()


def read_step_values(loss: Tensor, grad_norm: Tensor, micro_batches: Sequence[Mapping[str, Tensor]],
                     micro_stats: Sequence[dict[str, Any]], device: torch.device) -> tuple[float, float, int]:
    """(loss, gradient norm, non-pad tokens) as Python numbers, in one host transfer that also reads every
    one-element tensor of `micro_stats` (replaced in place by its value as a float, as `float(v)` gives it).
    A DTensor reads as its full value. Values go through float64: exact for float32 / bf16 / fp16 values and
    for counts below 2^53. The tensors are stacked per (device, dtype) before the cast: a few kernels, not one
    cast per value."""
    stat_keys = [(i, k) for i, s in enumerate(micro_stats) for k, v in s.items()
                 if isinstance(v, Tensor) and v.numel() == 1]
    tensors = [_whole(t) for t in (loss, grad_norm, *(non_pad_tokens(b) for b in micro_batches),
                                   *(micro_stats[i][k] for i, k in stat_keys))]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for j, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(j)
    with torch.no_grad():
        parts = [torch.stack([tensors[j] if tensors[j].ndim == 0 else tensors[j].reshape(()) for j in idx])
                 .to(device=device, dtype=torch.float64) for idx in groups.values()]
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
    values = [0.0] * len(tensors)
    for j, v in zip((j for idx in groups.values() for j in idx), flat):
        values[j] = v
    n = len(micro_batches)
    for (i, k), v in zip(stat_keys, values[2 + n:]):
        micro_stats[i][k] = v
    return values[0], values[1], int(sum(values[2:2 + n]))


def _whole(t: Tensor) -> Tensor:
    """A DTensor (FSDP2's gradient norm) as the plain tensor of its full value; other tensors unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


__all__ = ["grad_norm_and_clip", "make_adamw", "non_pad_tokens", "read_step_values"]
