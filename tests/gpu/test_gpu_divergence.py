"""`linear_divergence` on the test's device (backend auto: the Triton row kernel on CUDA) against its reference
twin on materialised float64 logits: every kind with temperature, biases, hard-label mixing and ignored rows,
fp32 and (CUDA) bf16 students, a real vocabulary on CUDA. Tolerances: `_gpu`."""

from __future__ import annotations

import pytest
import torch
from _gpu import GRAD_TOL, close_outputs, grad_err, on

from ludic_fast import linear_divergence
from ludic_fast import reference as R

KINDS = [dict(kind="forward_kl", temperature=0.8), dict(kind="reverse_kl", hard_weight=0.3),
         dict(kind="jsd", beta=0.4, temperature=1.5, hard_weight=0.2)]


def _params():
    out = [on("cpu", torch.float32, 13, 1021, k, id=f"cpu-fp32-{k['kind']}") for k in KINDS]
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        out += [on("cuda", dtype, 64, 151936, k, id=f"cuda-{name}-{k['kind']}") for k in KINDS]
    return out


@pytest.mark.parametrize("device,dtype,n,V,opts", _params())
def test_divergence_matches_reference(device, dtype, n, V, opts):
    g = torch.Generator().manual_seed(0)
    ds, dt = 64, 96
    hs = torch.randn(n, ds, generator=g).to(dtype)
    Ws = (torch.randn(V, ds, generator=g) * 0.2).to(dtype)
    bs = (torch.randn(V, generator=g) * 0.1).to(dtype)
    ht = torch.randn(n, dt, generator=g).to(dtype)
    Wt = (torch.randn(V, dt, generator=g) * 0.2).to(dtype)
    tgt = torch.randint(0, V, (n,), generator=g)
    tgt[1] = -100
    leaves = [x.double().requires_grad_() for x in (hs, Ws, bs)]
    ref = R.linear_divergence(leaves[0], leaves[1], ht.double(), Wt.double(), tgt, b_student=leaves[2], **opts)
    ref_grads = torch.autograd.grad(ref, leaves)
    dev = [x.to(device).requires_grad_() for x in (hs, Ws, bs)]
    out = linear_divergence(dev[0], dev[1], ht.to(device), Wt.to(device), tgt.to(device), b_student=dev[2],
                            memory_budget=16 * V * 8, **opts)
    close_outputs(out, ref, "loss")
    for name, got, want in zip(("hidden", "weight", "bias"), torch.autograd.grad(out, dev), ref_grads):
        assert got.dtype == dtype
        assert grad_err(got, want) <= GRAD_TOL[dtype], (name, grad_err(got, want))
