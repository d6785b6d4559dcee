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
         dict(kind="jsd", beta=0.4, temperature=1.5, hard_weight=0.2),
         dict(kind="jsd", beta=0.3, softcap=30.0, logit_scale=0.8, temperature=0.9, hard_weight=0.1)]


def _params():
    out = [on("cpu", torch.float32, 13, 1021, k, id=f"cpu-fp32-{k['kind']}-{i}") for i, k in enumerate(KINDS)]
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        out += [on("cuda", dtype, 64, 151936, k, id=f"cuda-{name}-{k['kind']}-{i}") for i, k in enumerate(KINDS)]
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


@pytest.mark.parametrize("device,V", [on("cpu", 1021, id="cpu"), on("cuda", 151936, id="cuda")])
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_distribution_teachers_and_masked_columns(device, V, kind):
    """fp32 student against a top-k teacher and a dense teacher with zero-mass columns, a per-token
    temperature and -inf student columns (the Triton kernel on CUDA), vs the float64 twin."""
    g = torch.Generator().manual_seed(1)
    n, ds = 32, 64
    hs = torch.randn(n, ds, generator=g)
    Ws = torch.randn(V, ds, generator=g) * 0.2
    bs = torch.zeros(V).index_fill(0, torch.arange(0, V, 97), float("-inf"))
    logp = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 3 + bs.double(), -1)  # 0 mass
    lp, idx = logp.topk(50, -1)
    probs = logp.exp().index_fill(1, torch.arange(5, V, 89), 0.0)
    temp = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    for teacher in (dict(teacher_topk=(idx, lp)), dict(teacher_probs=probs)):
        leaves = [x.double().requires_grad_() for x in (hs, Ws)]
        ref = R.linear_divergence(leaves[0], leaves[1], kind=kind, b_student=bs.double(), temperature=temp,
                                  **teacher)
        dev = [x.to(device).requires_grad_() for x in (hs, Ws)]
        on_dev = {k: (v.to(device) if k == "teacher_probs" else (v[0].to(device), v[1].to(device)))
                  for k, v in teacher.items()}
        out = linear_divergence(dev[0], dev[1], kind=kind, b_student=bs.to(device), temperature=temp.to(device),
                                memory_budget=16 * V * 8, **on_dev)
        assert torch.isfinite(ref) and torch.isfinite(out.cpu())
        close_outputs(out, ref, "loss")
        grads = zip(("hidden", "weight"), torch.autograd.grad(out, dev), torch.autograd.grad(ref, leaves))
        for name, got, want in grads:
            assert grad_err(got, want) <= GRAD_TOL[torch.float32], (name, grad_err(got, want))
