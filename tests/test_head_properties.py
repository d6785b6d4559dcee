"""Property test of the head (linear_logprobs and the fused-loss mode) against an independent float64
computation on float64 copies of the very inputs: random shapes (N, D, V down to 1), fp32 / fp64, a common
logit offset up to 1e3, scalar or per-token temperatures, softcaps, logit scales, columns masked by a bias of
-inf, ignored rows, vocabulary slices. Log-probs, entropies and the gradients of a random combination of both
agree to the rounding of the logits' size (fp32: a few steps of max |z|, for H relative to H: a perturbation
d of the logits moves H by at most 2 d H; fp64: 1e-9), and H is never negative. `check_case` is shared with
the Triton interpreter variant (tests/interpret/test_head_properties_kernels.py)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ludic_fast.ops import linear_logprobs
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform


@st.composite
def cases(draw, max_v: int = 40, dtypes=(torch.float32, torch.float64)):
    n, d, v = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(1, max_v))
    per_token = draw(st.booleans())
    return dict(
        n=n, d=d, v=v, seed=draw(st.integers(0, 2**16)), dtype=draw(st.sampled_from(dtypes)),
        offset=draw(st.sampled_from([0.0, 100.0, 1000.0])),
        sharpness=draw(st.sampled_from([1.0, 8.0])),  # 8: mostly confident rows
        temperature="per-token" if per_token else draw(st.floats(0.25, 4.0)),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        logit_scale=draw(st.sampled_from([1.0, 0.5, 3.0])),
        masked=draw(st.lists(st.integers(0, v - 1), max_size=v - 1, unique=True)) if v > 1 else [],
        ignored=draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)),
        path=draw(st.sampled_from(["generic", "fused"])),
        chunk_elements=draw(st.sampled_from([None, 8, 64])),
    )


def _float64_head(h, w, b, targets, temperature, softcap, logit_scale):
    """(logprob, entropy) of softcap(logit_scale (h W^T + b)) / T, float64, 0 log 0 = 0; 0 at ignored rows."""
    z = (h @ w.T + b) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature.reshape(-1, 1), -1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros((), dtype=torch.float64))).sum(-1)
    valid = targets >= 0
    lp = logp.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _ours(c, h, w, b, targets, temperature, u_lp, u_h, backend):
    """(logprobs, entropy, sum(u_lp lp + u_h H)) on c['path']."""
    if c["path"] == "generic":
        out = linear_logprobs(h, w, targets, bias=b, temperature=temperature, softcap=c["softcap"],
                              logit_scale=c["logit_scale"], backend=backend, chunk_elements=c["chunk_elements"])
        return out.logprobs, out.entropy, (u_lp * out.logprobs + u_h * out.entropy).sum()
    transform = HeadTransform.build(c["logit_scale"], c["softcap"], temperature, h.shape[0], h.device)

    def objective(lp, ent, rows):
        sel = slice(None) if rows is None else rows
        return (u_lp[sel] * lp).sum() + (u_h[sel] * ent).sum()

    plan = FusedPlan(transform, objective, False, True, c["chunk_elements"], backend)
    loss, lp, ent = fused_head_loss(h, w, b, targets, plan)
    return lp, ent, loss


def check_case(c: dict, backend: str, device: str = "cpu") -> None:
    """Our head on `backend` against the float64 computation for one drawn case (module docstring)."""
    g = torch.Generator().manual_seed(c["seed"])
    n, v, dtype = c["n"], c["v"], c["dtype"]
    h64 = torch.randn(n, c["d"], generator=g, dtype=torch.float64) * c["sharpness"]
    w64 = torch.randn(v, c["d"], generator=g, dtype=torch.float64)
    mask = torch.zeros(v, dtype=torch.float64)
    mask[c["masked"]] = -math.inf
    b64 = torch.randn(v, generator=g, dtype=torch.float64) + c["offset"] + mask
    keep = torch.isfinite(b64).nonzero().squeeze(1)
    targets = keep[torch.randint(0, keep.numel(), (n,), generator=g)]
    targets[c["ignored"]] = -100
    temp = c["temperature"]
    temp64 = (torch.rand(n, generator=g, dtype=torch.float64) * 3.75 + 0.25 if temp == "per-token"
              else torch.full((n,), float(temp), dtype=torch.float64))
    u_lp, u_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    x = [t.to(dtype) for t in (h64, w64, b64)]  # the inputs, then their float64 copies: the same values
    ref_leaves = [t.double().clone().requires_grad_(True) for t in x]
    valid = targets >= 0
    lp64, ent64 = _float64_head(*ref_leaves, targets, temp64, c["softcap"], c["logit_scale"])
    ref_grads = torch.autograd.grad((u_lp * lp64 + u_h * ent64).sum(), ref_leaves)
    leaves = [t.clone().to(device).requires_grad_(True) for t in x]
    temperature = temp64.to(dtype).to(device) if temp == "per-token" else float(temp)
    lp, ent, loss = _ours(c, *leaves, targets.to(device), temperature, u_lp.to(dtype).to(device),
                          u_h.to(dtype).to(device), backend)
    assert lp.dtype == ent.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    lp, ent, lp64, ent64 = lp.detach().cpu().double(), ent.detach().cpu().double(), lp64.detach(), ent64.detach()
    # rounding of the logits' size: |z| <= (|h W^T| + |b|) scale / T (or the softcap / T)
    raw = float((h64.abs() @ w64.abs().T).max() + b64[keep].abs().max())
    z_max = max(1.0, (raw * c["logit_scale"] if c["softcap"] is None else c["softcap"]) / float(temp64.min()))
    eps = 1e-9 if dtype == torch.float64 else 64 * 2.0**-24 * z_max
    assert bool((ent >= 0).all()), ent
    assert bool(((lp - lp64).abs() <= 4 * eps + 1e-6 * lp64.abs()).all()), (lp, lp64)
    h_tol = (1e-3 + 4 * eps) * ent64 + (1e-7 if dtype == torch.float32 else 1e-12)
    assert bool(((ent - ent64).abs() <= h_tol).all()), (ent, ent64)
    assert bool((lp[~valid] == 0).all()) and bool((ent[~valid] == 0).all())
    grads = torch.autograd.grad(loss, leaves)
    scale = max(1.0, float(h64.abs().max()), float(w64.abs().max())) * float(u_lp.abs().max() + u_h.abs().max())
    for name, a, b in zip(("hidden", "weight", "bias"), grads, ref_grads):
        a = a.cpu().double()
        assert bool(torch.isfinite(a).all()), name
        tol = eps * max(1.0, float(b.abs().max())) * scale * c["logit_scale"] / min(1.0, float(temp64.min()))
        assert float((a - b).abs().max()) <= tol, (name, float((a - b).abs().max()), tol)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(c=cases())
def test_torch_backend_matches_float64(c):
    check_case(c, "torch")
