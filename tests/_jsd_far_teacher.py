"""A JSD case whose student gradient is a small difference, for the torch backend's test and the Triton
kernel's: a top-k teacher on the k tokens the student finds least likely. Nearly all of the student's mass
then lies on the teacher's zero tail, where a = s - log m = -log(1 - β) in every column, and
dD/dz_s = (1 - β) p_s (a - ā) there is a difference of ~k/V (or less) of a and ā: a rounding of ā, or of
Σ p_s (1 + ε after a rounded log-partition), shows in the gradient magnified V/k-fold."""

from __future__ import annotations

import torch

from ludic_fast import linear_divergence
from ludic_fast import reference as R


def jsd_errors_far_teacher(V: int, k: int, backend: str, device: str = "cpu", n: int = 4, ds: int = 16,
                           seed: int = 0) -> tuple[float, float, float]:
    """(relative error of the loss, max |error| / max |want| of d(hidden) and of d(weight)) of an fp32
    student's JSD (β = 0.5) on `backend` against the float64 twin."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, ds, generator=g)
    Ws = torch.randn(V, ds, generator=g) * 0.2
    idx = (hs @ Ws.T).topk(k, -1, largest=False).indices
    lp = torch.log_softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1)
    leaves = [x.double().requires_grad_() for x in (hs, Ws)]
    want = R.linear_divergence(*leaves, kind="jsd", teacher_topk=(idx, lp))
    got_leaves = [x.to(device).requires_grad_() for x in (hs, Ws)]
    got = linear_divergence(*got_leaves, kind="jsd", teacher_topk=(idx.to(device), lp.to(device)),
                            backend=backend)
    errs = [float((a.cpu().double() - b).abs().max() / b.abs().max())
            for a, b in zip(torch.autograd.grad(got, got_leaves), torch.autograd.grad(want, leaves))]
    got, want = float(got.detach()), float(want.detach())
    return abs(got - want) / want, errs[0], errs[1]
