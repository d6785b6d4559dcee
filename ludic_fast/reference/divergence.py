"""Reference twin of `ludic_fast.ops.linear_divergence`: both heads' logits materialised, autograd for gradients.

    z_s = softcap(logit_scale (h_s W_s^T + b_s)) / T,   s = log_softmax(z_s)
    teacher log-probs t: log_softmax(z_t) of the teacher head (the same transform, its rows past V dropped),
        or log_softmax(log p / T) of dense probabilities p, or of top-k log-probs (-inf off the top k:
        tail 'renormalize'), or, for tail 'bucket', both distributions coarsened to the k top-k tokens plus
        one "every other token" outcome (the teacher's 1 - Σ_k e^{lp}, the student's Σ_tail p_s)
    forward_kl Σ p_t (t - s);  reverse_kl Σ p_s (s - t);
    jsd β Σ p_t (t - log m) + (1 - β) Σ p_s (s - log m),  m = β p_t + (1 - β) p_s;
    every term with p = 0 counts 0 (0 log 0 = 0); the divergence is clamped at 0 (its math is >= 0);
    with targets and hard_weight α: (1 - α) D + α CE, CE = -log_softmax(z_s T)_y (the untempered logits);
    ignore_index tokens count for nothing (and have entropy 0); entropy H = -Σ p_s s (no gradient);
    reduction mean (over counted tokens) | sum | none.
Float64 when the student's hidden or weight is float64, else float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _transform(raw: Tensor, logit_scale: float, softcap: float | None, temperature: Tensor) -> Tensor:
    z = raw * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature[..., None]


def _plogr(p: Tensor, log_p: Tensor, log_r: Tensor) -> Tensor:
    """Σ_v p (log p - log r) with the terms of p = 0 exactly 0 (and no NaN in their gradients)."""
    live = p > 0
    return (p * (torch.where(live, log_p, 0.0) - torch.where(live, log_r, 0.0))).sum(-1)


def _divergence(kind: str, beta: float, s: Tensor, t: Tensor) -> Tensor:
    ps, pt = s.exp(), t.exp()
    if kind == "forward_kl":
        return _plogr(pt, t, s)
    if kind == "reverse_kl":
        return _plogr(ps, s, t)
    if kind == "jsd":
        live = (ps > 0) | (pt > 0)  # log m = -inf where both are 0 (and no NaN in the gradient there)
        log_m = torch.logaddexp(torch.where(live, t, 0.0) + math.log(beta),
                                torch.where(live, s, 0.0) + math.log1p(-beta))
        log_m = torch.where(live, log_m, float("-inf"))
        return beta * _plogr(pt, t, log_m) + (1 - beta) * _plogr(ps, s, log_m)
    raise ValueError(f"kind must be forward_kl, reverse_kl or jsd, got {kind!r}")


def _coarsened(s: Tensor, idx: Tensor, lp: Tensor) -> tuple[Tensor, Tensor]:
    """(student, teacher) log-probs over the k top-k tokens and one tail outcome."""
    s_top = s.gather(-1, idx)
    s_tail = torch.logsumexp(s.scatter(-1, idx, float("-inf")), -1, keepdim=True)
    lp = lp.double()
    t_tail = torch.log(torch.clamp(1.0 - lp.exp().sum(-1, keepdim=True), min=0.0))
    t = torch.cat([lp, t_tail], -1)
    return torch.cat([s_top, s_tail], -1), (t - torch.logsumexp(t, -1, keepdim=True)).to(s.dtype)


def linear_divergence(
    h_student: Tensor,
    W_student: Tensor,
    h_teacher: Tensor | None = None,
    W_teacher: Tensor | None = None,
    targets: Tensor | None = None,
    *,
    teacher_probs: Tensor | None = None,
    teacher_topk: tuple[Tensor, Tensor] | None = None,
    teacher_tail: str = "renormalize",
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float | Tensor = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    b_student: Tensor | None = None,
    b_teacher: Tensor | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The divergence on materialised [N, V] logits of both models (module docstring)."""
    dt = torch.float64 if torch.float64 in (h_student.dtype, W_student.dtype) else torch.float32
    V = W_student.shape[0]
    lead = h_student.shape[:-1]
    temp = torch.as_tensor(temperature, dtype=dt, device=h_student.device).expand(lead)
    raw_s = h_student.to(dt) @ W_student.to(dt).T
    if b_student is not None:
        raw_s = raw_s + b_student.to(dt)
    zs = _transform(raw_s, logit_scale, softcap, temp)
    s = torch.log_softmax(zs, -1)
    if teacher_topk is not None and teacher_tail == "bucket":
        s_div, t = _coarsened(s, teacher_topk[0].long(), teacher_topk[1].detach())
    else:
        s_div = s
        if teacher_probs is not None:
            zt = teacher_probs.detach()[..., :V].to(dt).log() / temp[..., None]
        elif teacher_topk is not None:
            lp = torch.full((*lead, V), float("-inf"), dtype=dt, device=h_student.device)
            zt = lp.scatter(-1, teacher_topk[0].long(), teacher_topk[1].detach().to(dt)) / temp[..., None]
        else:
            raw_t = h_teacher.detach().to(dt) @ W_teacher.detach()[:V].to(dt).T
            if b_teacher is not None:
                raw_t = raw_t + b_teacher.detach()[:V].to(dt)
            zt = _transform(raw_t, logit_scale, softcap, temp)
        t = torch.log_softmax(zt, -1)
    d = _divergence(kind, beta, s_div, t).clamp(min=0.0)
    valid = torch.ones(d.shape, dtype=dt, device=d.device)
    if targets is not None:
        valid = (targets != ignore_index).to(dt)
        if hard_weight > 0:
            safe = torch.where(targets != ignore_index, targets, 0).long()
            ce = -torch.log_softmax(zs * temp[..., None], -1).gather(-1, safe[..., None]).squeeze(-1)
            d = (1 - hard_weight) * d + hard_weight * ce
    d = torch.where(valid > 0, d, 0.0)
    if reduction == "none":
        loss = d
    else:
        loss = d.sum() if reduction == "sum" else d.sum() / valid.sum().clamp(min=1.0)
    if not return_entropy:
        return loss
    ps = s.exp()
    return loss, (-(ps * torch.where(ps > 0, s, 0.0)).sum(-1) * valid).detach()


__all__ = ["linear_divergence"]
