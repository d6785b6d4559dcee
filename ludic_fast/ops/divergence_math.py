"""Per-chunk math of `linear_divergence` on the torch backend: from a chunk of the student's log-probs
s = log_softmax(z_s) and the teacher's log-probs t, the divergence D per row and dD/dz_s.

    forward_kl   D = Σ_v p_t (t - s)                                dD/dz_s = p_s - p_t
    reverse_kl   D = Σ_v p_s (s - t)                                dD/dz_s = p_s (s - t - D)
    jsd          D = β Σ p_t (t - log m) + (1 - β) Σ p_s (s - log m),  m = β p_t + (1 - β) p_s
                 dD/dz_s = (1 - β) p_s (g - Σ_v p_s g),  g = s - log m

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


def _pdot_(p: Tensor, x: Tensor, out: Tensor) -> Tensor:
    """Σ_v p x per row, the terms with p = 0 exactly 0 (x may be ±inf or NaN there; x is zeroed there). The
    products go to `out` (a free chunk buffer, or x itself) and are summed by torch's pairwise row sum: a
    BLAS dot of 150k terms loses ~1e-4 of a KL of 4 in fp32."""
    x.masked_fill_(p == 0, 0.0)
    return torch.mul(p, x, out=out).sum(1)


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
    log_m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
    p = t.exp()  # p_t for now
    kl_t = _pdot_(p, t.sub_(log_m), t)
    ps = torch.exp(s, out=p)
    g = s.sub_(log_m)
    kl_s = _pdot_(ps, g, log_m)  # g is 0 where p_s = 0 from here on
    loss = beta * kl_t + (1.0 - beta) * kl_s
    return loss, (g.sub_(kl_s[:, None]).mul_(ps).mul_(1.0 - beta) if want_grad else None), ps


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
