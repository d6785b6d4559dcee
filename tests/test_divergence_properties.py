"""Property test of linear_divergence against an independent float64 computation (the reference twin on
float64 copies of the very inputs): random shapes (N, D, V down to 1), fp32 / fp64, a common logit offset up
to 1e3, scalar or per-token temperatures, softcaps, logit scales, columns masked by -inf in both heads, ignored
rows, hard-label mixing, every kind. The loss, the student's entropy and gradients must agree to rounding of the
logits' size (fp32: a few steps of max |z|; fp64: 1e-9). `check_case` is shared with the Triton interpreter
variant (tests/interpret/test_divergence_rows_properties.py)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ludic_fast import linear_divergence
from ludic_fast import reference as R


@st.composite
def cases(draw, max_v: int = 40, dtypes=(torch.float32, torch.float64)):
    n, d, dt, v = draw(st.integers(1, 6)), draw(st.integers(1, 8)), draw(st.integers(1, 8)), draw(st.integers(1, max_v))
    kind = draw(st.sampled_from(["forward_kl", "reverse_kl", "jsd"]))
    per_token = draw(st.booleans())
    masked = draw(st.lists(st.integers(0, v - 1), max_size=v - 1, unique=True)) if v > 1 else []
    return dict(
        n=n, d=d, dt=dt, v=v, kind=kind, seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(dtypes)),
        beta=draw(st.floats(0.1, 0.9)),
        offset=draw(st.sampled_from([0.0, 100.0, 1000.0])),
        temperature=draw(st.floats(0.25, 4.0)) if not per_token else "per-token",
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        logit_scale=draw(st.sampled_from([1.0, 0.5, 3.0])),
        masked=masked,
        ignored=draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)),
        hard_weight=draw(st.sampled_from([0.0, 0.0, 0.3])),
        entropy=draw(st.booleans()),
    )


def check_case(c: dict, backend: str, device: str = "cpu") -> None:
    """The op on `backend` against the float64 reference for one drawn case (module docstring)."""
    g = torch.Generator().manual_seed(c["seed"])
    n, v, dtype = c["n"], c["v"], c["dtype"]
    hs = torch.randn(n, c["d"], generator=g, dtype=torch.float64)
    Ws = torch.randn(v, c["d"], generator=g, dtype=torch.float64)
    ht = torch.randn(n, c["dt"], generator=g, dtype=torch.float64)
    Wt = torch.randn(v, c["dt"], generator=g, dtype=torch.float64)
    mask = torch.zeros(v, dtype=torch.float64)
    mask[c["masked"]] = -math.inf
    bs = torch.randn(v, generator=g, dtype=torch.float64) + c["offset"] + mask
    bt = torch.randn(v, generator=g, dtype=torch.float64) + c["offset"] + mask
    tgt = torch.randint(0, v, (n,), generator=g)
    tgt[c["ignored"]] = -100
    temp = c["temperature"]
    if temp == "per-token":
        temp = torch.rand(n, generator=g, dtype=torch.float64) * 3.75 + 0.25
    leaves = [x.to(dtype).requires_grad_(True) for x in (hs, Ws)]
    inputs = [x.to(dtype) for x in (ht, Wt, bs, bt)]
    kw = dict(kind=c["kind"], beta=c["beta"], softcap=c["softcap"], logit_scale=c["logit_scale"],
              hard_weight=c["hard_weight"], reduction="none")
    ref_leaves = [x.detach().double().requires_grad_(True) for x in leaves]
    ref, ref_h = R.linear_divergence(ref_leaves[0], ref_leaves[1], inputs[0].double(), inputs[1].double(), tgt,
                                     b_student=inputs[2].double(), b_teacher=inputs[3].double(), temperature=temp,
                                     return_entropy=True, **kw)
    dev = [x.detach().to(device).requires_grad_(True) for x in leaves]
    out = linear_divergence(dev[0], dev[1], inputs[0].to(device), inputs[1].to(device), tgt.to(device),
                            b_student=inputs[2].to(device), b_teacher=inputs[3].to(device), backend=backend,
                            temperature=temp.to(dtype).to(device) if isinstance(temp, torch.Tensor) else temp,
                            return_entropy=c["entropy"], **kw)
    out, ent = out if c["entropy"] else (out, None)
    assert out.dtype == dtype
    # rounding of the logits' size: |z| <= (|h W^T| + |b|) scale / T (or the softcap / T)
    t_min = float(temp.min()) if isinstance(temp, torch.Tensor) else temp
    raw = (hs @ Ws.T).abs().max() + bs[torch.isfinite(bs)].abs().max()  # one column at least is unmasked
    z_max = float(raw) * c["logit_scale"] if c["softcap"] is None else c["softcap"]
    z_max = max(1.0, z_max / t_min, z_max)  # CE runs on the untempered logits
    eps = 1e-9 if dtype == torch.float64 else 64 * 2.0**-24 * z_max
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out.cpu()), finite), (out, ref)
    assert (out.cpu()[~finite] == ref[~finite]).all()  # +inf where the math is
    if ent is not None:
        assert ent.dtype == dtype and (ent.cpu().double() - ref_h).abs().max() <= eps * (1 + float(ref_h.abs().max()))
    if not finite.all():
        return
    assert (out.cpu().double() - ref).abs().max() <= eps * (1 + float(ref.abs().max()))
    up = torch.rand(n, generator=g, dtype=torch.float64)
    for name, a, b in zip(("hidden", "weight"), torch.autograd.grad(out, dev, up.to(dtype).to(device)),
                          torch.autograd.grad(ref, ref_leaves, up)):
        scale = max(1.0, float(b.abs().max())) * max(1.0, float(hs.abs().max()), float(Ws.abs().max()))
        assert (a.cpu().double() - b).abs().max() <= eps * scale / min(1.0, t_min), name


@settings(max_examples=30, deadline=None, derandomize=True)
@given(c=cases())
def test_torch_backend_matches_float64(c):
    check_case(c, "torch")
