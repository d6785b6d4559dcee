"""The distillation row kernel (backend='triton') equals the torch path of linear_divergence (under
TRITON_INTERPRET=1 on CPU, or on CUDA): loss and student gradients, every kind, with temperature, biases,
hard-label mixing, ignored rows, per-token reduction, several chunks and a vocabulary not a multiple of the
block."""

from __future__ import annotations

import pytest
import torch
from _interp import DEVICE, MARKS

from ludic_fast import linear_divergence

pytestmark = MARKS

N, DS, DT, V = 7, 24, 16, 2053  # V spans two blocks of 2048 and a tail


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, DS, generator=g).to(DEVICE).requires_grad_(True)
    Ws = (torch.randn(V, DS, generator=g) * 0.4).to(DEVICE).requires_grad_(True)
    bs = (torch.randn(V, generator=g) * 0.3).to(DEVICE).requires_grad_(True)
    ht = torch.randn(N, DT, generator=g).to(DEVICE)
    Wt = (torch.randn(V, DT, generator=g) * 0.4).to(DEVICE)
    bt = (torch.randn(V, generator=g) * 0.3).to(DEVICE)
    tgt = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    tgt[3] = -100
    return hs, Ws, bs, ht, Wt, bt, tgt


CASES = [
    dict(kind="forward_kl"),
    dict(kind="reverse_kl", temperature=1.7),
    dict(kind="jsd", beta=0.3),
    dict(kind="forward_kl", temperature=0.8, hard_weight=0.4),
    dict(kind="jsd", beta=0.6, temperature=1.3, hard_weight=0.25),
    dict(kind="reverse_kl", hard_weight=0.5, reduction="none"),
]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_triton_equals_torch(opts):
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs()
    kw = dict(opts, b_student=bs, b_teacher=bt, memory_budget=16 * V * 3)  # chunks of 3 rows
    up = torch.rand(N, generator=torch.Generator().manual_seed(1)).to(DEVICE) if opts.get("reduction") else None
    outs = {}
    for backend in ("torch", "triton"):
        out = linear_divergence(hs, Ws, ht, Wt, tgt, backend=backend, **kw)
        grads = torch.autograd.grad(out, (hs, Ws, bs), up)
        outs[backend] = (out.detach(), grads)
    (ref, ref_g), (got, got_g) = outs["torch"], outs["triton"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_triton_without_targets():
    hs, Ws, bs, ht, Wt, bt, _ = _inputs(1)
    ref = linear_divergence(hs, Ws, ht, Wt, kind="jsd", backend="torch")
    got = linear_divergence(hs, Ws, ht, Wt, kind="jsd", backend="triton")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
