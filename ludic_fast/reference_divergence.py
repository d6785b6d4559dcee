"""Reference twin of `ludic_fast.ops.linear_divergence`: both heads' logits materialised, autograd for gradients.

    s = log_softmax((h_s W_s^T + b_s) / T),  t = log_softmax((h_t W_t^T + b_t) / T)   (teacher detached)
    forward_kl Σ p_t (t - s);  reverse_kl Σ p_s (s - t);
    jsd β Σ p_t (t - log m) + (1 - β) Σ p_s (s - log m),  m = β p_t + (1 - β) p_s;
    with targets and hard_weight α: (1 - α) D + α CE, CE = -log_softmax(z_s)_y at T = 1;
    ignore_index tokens count for nothing;
    reduction mean (over counted tokens) | sum | none.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def linear_divergence(
    h_student: Tensor,
    W_student: Tensor,
    h_teacher: Tensor,
    W_teacher: Tensor,
    targets: Tensor | None = None,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    b_student: Tensor | None = None,
    b_teacher: Tensor | None = None,
) -> Tensor:
    """The divergence on materialised [N, V] logits of both models (float64 when the student is)."""
    dt = torch.float64 if torch.float64 in (h_student.dtype, W_student.dtype) else torch.float32
    zs = h_student.to(dt) @ W_student.to(dt).T
    zt = (h_teacher.detach().to(dt) @ W_teacher.detach().to(dt).T)
    if b_student is not None:
        zs = zs + b_student.to(dt)
    if b_teacher is not None:
        zt = zt + b_teacher.detach().to(dt)
    s = torch.log_softmax(zs / temperature, -1)
    t = torch.log_softmax(zt / temperature, -1)
    if kind == "forward_kl":
        d = (t.exp() * (t - s)).sum(-1)
    elif kind == "reverse_kl":
        d = (s.exp() * (s - t)).sum(-1)
    elif kind == "jsd":
        log_m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
        d = beta * (t.exp() * (t - log_m)).sum(-1) + (1 - beta) * (s.exp() * (s - log_m)).sum(-1)
    else:
        raise ValueError(f"kind must be forward_kl, reverse_kl or jsd, got {kind!r}")
    valid = torch.ones(d.shape, dtype=dt)
    if targets is not None:
        valid = (targets != ignore_index).to(dt)
        if hard_weight > 0:
            safe = torch.where(targets != ignore_index, targets, 0).long()
            ce = -torch.log_softmax(zs, -1).gather(-1, safe[..., None]).squeeze(-1)
            d = (1 - hard_weight) * d + hard_weight * ce
    d = d * valid
    if reduction == "none":
        return d
    return d.sum() if reduction == "sum" else d.sum() / valid.sum().clamp(min=1.0)


__all__ = ["linear_divergence"]
