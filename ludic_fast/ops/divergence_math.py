"""Per-chunk math of `linear_divergence` on the torch backend: from a chunk of the student's log-probs
s = log_softmax(z_s) and the teacher's log-probs t, the divergence D per row and dD/dz_s.

    forward_kl   D = Σ_v p_t (t - s)                                dD/dz_s = p_s - p_t
    reverse_kl   D = Σ_v p_s (s - t)                                dD/dz_s = p_s (s - t - D)
    jsd          D = β Σ p_t b + (1 - β) Σ p_s a,  m = β p_t + (1 - β) p_s,  a = s - log m,  b = t - log m
                 dD/dz_s = (1 - β) p_s (a - ā),  ā = Σ_v p_s a / Σ_v p_s

JSD's log-ratios come from one difference per column, d = t - s, never as a difference of two logs:
L = log1p(w expm1(-|d|)) with w = β where d <= 0 and 1 - β where d > 0, then a = -max(d, 0) - L and
b = min(d, 0) - L (exact where one side has no mass: a = -log(1 - β) where p_t = 0, b = -log β where p_s = 0;
exactly 0 where p_s = p_t). The mean ā is divided by Σ p_s: the rounded log-partition leaves Σ p_s = 1 + ε
(ε ~ 1e-6 at V = 152k in fp32), and p_s (a - Σ p_s a) would carry ε ā p_s, which swamps a gradient that is a
small difference (a top-k teacher's zero tail, where a = -log(1 - β) on nearly all of the student's mass).
There a - ā is ~1e-3 of a and ā or less, so JSD's sums add up in float64 (`_row_sum64`) and ā is
subtracted as a pair of floats (hi + lo = ā): an ā rounded to fp32 (~1e-7 of it) would cost ~1e-4 of
the gradient.

A zero-mass column (log-prob -inf) adds exactly 0 to every sum and gradient (0 · log 0 = 0). Where the
student has mass and the teacher none, reverse KL is +inf (so is forward KL the other way round); a row of
+inf reverse KL gets a NaN gradient, since the divergence has no derivative there. D is clamped at 0.

A top-k teacher with the 'bucket' tail compares the two distributions coarsened to k + 1 outcomes (the k
tokens, then every other token): with S = coarse student log-probs, G = dD/dS by the formulas above,
dD/dz_j = G_j for a top-k token and G_tail p_j / P_tail for a tail token (P_tail the student's tail mass).

The student's entropy is taken relative to the row maximum, x = z - max z:
H = log σ - τ / σ,  σ = Σ e^x,  τ = Σ e^x x  (σ, τ summed in float64), so a confident token's small H keeps
a relative error instead of one rounding step of the logits' size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def log_softmax_(z: Tensor) -> Tensor:
    """z - logsumexp(z) per row, in place."""
    return z.sub_(torch.logsumexp(z, 1, keepdim=True))


def entropy(z: Tensor) -> Tensor:
    """Shifted entropy of softmax(z) per row (module docstring), in z's dtype, >= 0."""
    x = z - z.amax(1, keepdim=True)
    x.clamp_(min=torch.finfo(x.dtype).min)  # a -inf column: e^x x = 0 · finite = 0
    e = x.exp()
    sigma = e.sum(1, dtype=torch.float64)
    tau = e.mul_(x).sum(1, dtype=torch.float64)
    return (sigma.log() - tau / sigma).clamp_(min=0.0).to(z.dtype)


def _pdot_(p: Tensor, x: Tensor, out: Tensor, wide: bool = False) -> Tensor:
    """Σ_v p x per row, the terms with p = 0 exactly 0 (x may be ±inf or NaN there; x is zeroed there). The
    products go to `out` (a free chunk buffer, or x itself) and are summed by torch's pairwise row sum (a
    BLAS dot of 150k terms loses ~1e-4 of a KL of 4 in fp32), or with `wide` by `_row_sum64`."""
    x.masked_fill_(p == 0, 0.0)
    prod = torch.mul(p, x, out=out)
    return _row_sum64(prod) if wide else prod.sum(1)


def _row_sum64(x: Tensor, block: int = 16384) -> Tensor:
    """Σ_v x per row in float64, with a float64 copy of at most `block` columns at a time."""
    total = x.new_zeros(x.shape[0], dtype=torch.float64)
    for j in range(0, x.shape[1], block):
        total += x[:, j:j + block].sum(1, dtype=torch.float64)
    return total


def dense_divergence(kind: str, beta: float, s: Tensor, t: Tensor,
                     want_grad: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """(D, dD/dz_s or None, p_s) of log-prob chunks s and t (both consumed: overwritten in place)."""
    if kind == "forward_kl":
        pt = t.exp()
        diff = t.sub_(s)
        loss = _pdot_(pt, diff, diff)
        ps = s.exp_()
        return loss, (torch.sub(ps, pt, out=t) if want_grad else None), ps
    if kind == "reverse_kl":
        ps = s.exp()
        diff = s.sub_(t)
        loss = _pdot_(ps, diff, t)
        if not want_grad:
            return loss, None, ps
        dz = diff.sub_(loss[:, None]).mul_(ps)  # diff is 0 where p_s = 0
        return loss, dz.mul_(torch.where(torch.isinf(loss), math.nan, 1.0).to(dz.dtype)[:, None]), ps
    a, b = _mixture_log_ratios_(torch.sub(t, s), beta)
    pt, ps = t.exp_(), s.exp_()
    kl_t = _pdot_(pt, b, b, wide=True)
    kl_s = _pdot_(ps, a, pt, wide=True)  # a is 0 where p_s = 0 from here on
    loss = (beta * kl_t + (1.0 - beta) * kl_s).to(s.dtype)
    if not want_grad:
        return loss, None, ps
    mean = kl_s / _row_sum64(ps)
    hi = mean.to(a.dtype)
    return loss, a.sub_(hi[:, None]).sub_((mean - hi).to(a.dtype)[:, None]).mul_(ps).mul_(1.0 - beta), ps


def _mixture_log_ratios_(d: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(a, b) = (s - log m, t - log m) from d = t - s (module docstring); d is consumed (b is written over
    it). NaN where both sides have no mass (d = -inf - -inf): every user masks those columns."""
    w = (d > 0).to(d.dtype).mul_(1.0 - 2.0 * beta).add_(beta)
    L = d.abs().neg_().expm1_().mul_(w).log1p_()
    a = torch.clamp(d, min=0.0, out=w).add_(L).neg_()
    return a, d.clamp_(max=0.0).sub_(L)


def bucket_divergence(kind: str, beta: float, s: Tensor, idx: Tensor, t_coarse: Tensor,
                      want_grad: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """(D, dD/dz_s or None, p_s) against a coarse teacher `t_coarse [n, k+1]` (log-probs of the top-k tokens
    `idx [n, k]`, then of the tail); s is consumed."""
    s_top = s.gather(1, idx)
    log_tail = torch.logsumexp(s.scatter_(1, idx, float("-inf")), 1)
    s.scatter_(1, idx, s_top)
    coarse = torch.cat([s_top, log_tail[:, None]], 1)
    loss, g, _ = dense_divergence(kind, beta, coarse, t_coarse, True)
    if not want_grad:
        return loss, None, s.exp_()
    # tail columns: G_tail e^{s_j - log P_tail}; a row without tail mass has p_j = 0 there
    shift = torch.where(torch.isinf(log_tail), 0.0, log_tail).to(s.dtype)
    dz = (s - shift[:, None]).exp_().mul_(g[:, -1:])
    dz.scatter_(1, idx, g[:, :-1])
    return loss, dz, s.exp_()


__all__ = ["log_softmax_", "entropy", "dense_divergence", "bucket_divergence"]
