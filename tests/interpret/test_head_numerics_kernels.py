"""The head's numerics at the edges on the Triton kernels (fused and workspace strategies, the TMA variant, the
fused-loss kernels), at small shapes: the cases of tests/test_head_numerics.py (tests/_head_numerics.py)
against the same float64."""

from __future__ import annotations

import pytest
import torch
from _head_numerics import (
    N,
    assert_entropy_exact,
    confident_rows,
    float64_head,
    grads64,
    masked_case,
    rel_err,
    tied_rows,
)
from _interp import DEVICE, MARKS

from ludic_fast.ops import linear_logprobs
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform

pytestmark = MARKS
ROUTES = ["fused", "workspace", "fused-loss-fused", "fused-loss-workspace"]


def triton_call(route, monkeypatch, h, w, b, targets, g_lp, g_h, temperature=1.0):
    """(logprobs, entropy, differentiable sum(g_lp lp + g_h H)) on the triton backend by `route`."""
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", route.rsplit("-", 1)[-1])
    h, w, b, targets, g_lp, g_h = (x.to(DEVICE) for x in (h, w, b, targets, g_lp, g_h))
    if not route.startswith("fused-loss"):
        out = linear_logprobs(h, w, targets, bias=b, temperature=temperature, backend="triton")
        return out.logprobs, out.entropy, (g_lp * out.logprobs + g_h * out.entropy).sum()
    transform = HeadTransform.build(1.0, None, temperature, h.shape[0], h.device)

    def objective(lp, ent, rows):
        sel = slice(None) if rows is None else rows
        return (g_lp[sel] * lp).sum() + (g_h[sel] * ent).sum()

    plan = FusedPlan(transform, objective, False, True, backend="triton")
    loss, lp, ent = fused_head_loss(h, w, b, targets, plan)
    return lp, ent, loss


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_entropy_of_confident_tokens(route, offset, monkeypatch):
    h, w, b, targets = confident_rows(offset)
    lp, ent, _ = triton_call(route, monkeypatch, h, w, b, targets, torch.ones(N), torch.ones(N))
    assert_entropy_exact(ent.cpu(), float64_head(h, w, b, targets)[1])


@pytest.mark.parametrize("route", ["fused", "workspace"])
def test_entropy_gradient_of_confident_tokens(route, monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]
    targets = torch.randint(0, 64, (N,), generator=g)
    h = torch.linspace(12, 25, N)[:, None] * w[targets] + 0.05 * torch.randn(N, 64, generator=g)
    b = torch.full((64,), 1e3) + 0.1 * torch.randn(64, generator=g)
    g_lp, g_h = torch.zeros(N), torch.randn(N, generator=g)
    leaves = [x.clone().to(DEVICE).requires_grad_() for x in (h, w, b)]
    loss = triton_call(route, monkeypatch, *leaves, targets, g_lp, g_h)[2]
    grads = torch.autograd.grad(loss, leaves)
    _, _, want_grads = grads64(h, w, b, targets, g_lp, g_h)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert rel_err(got.cpu(), want) <= 1e-3, (name, rel_err(got.cpu(), want))


@pytest.mark.parametrize("route", [*ROUTES, "fused-tma-bf16"])
def test_masked_vocabulary_is_finite_and_exact(route, monkeypatch):
    h, w, b, targets, masked, keep = masked_case()
    bf16 = route.endswith("bf16")
    if bf16:  # the TMA variant (bf16 on sm_90 configs: the interpreter's); the float64 twin takes the same values
        monkeypatch.setenv("LUDIC_FAST_TMA", "1")
        h, w = h.bfloat16(), w.bfloat16()
    g = torch.Generator().manual_seed(3)
    g_lp, g_h = torch.randn(N, generator=g), torch.randn(N, generator=g)
    leaves = [x.clone().to(DEVICE).requires_grad_() for x in (h, w, b)]
    lp, ent, loss = triton_call(route.removesuffix("-tma-bf16"), monkeypatch, *leaves, targets, g_lp, g_h, 0.7)
    grads = [x.float().cpu() for x in torch.autograd.grad(loss, leaves)]
    lp64, ent64, (dh64, dw64, db64) = grads64(h.float(), w.float(), b, targets, g_lp, g_h, keep, 0.7)
    tol = 2e-2 if bf16 else 1e-5  # bf16: d(raw) enters the gradient GEMMs rounded to bf16
    torch.testing.assert_close(lp.detach().cpu().double(), lp64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.detach().cpu().double(), ent64, rtol=1e-5, atol=1e-6)
    dh, dw, db = grads
    assert all(bool(torch.isfinite(x).all()) for x in grads)
    assert bool((dw[masked] == 0).all()) and bool((db[masked] == 0).all())
    assert rel_err(dh, dh64) <= tol and rel_err(dw, dw64) <= tol and rel_err(db, db64) <= tol


@pytest.mark.parametrize("route", ROUTES)
def test_tied_maxima(route, monkeypatch):
    """The row maximum held by several columns, in several vocabulary tiles: each tie counts e^0 = 1."""
    h, w, b, targets = tied_rows()
    lp, ent, _ = triton_call(route, monkeypatch, h, w, b, targets, torch.ones(N), torch.ones(N))
    lp64, ent64 = float64_head(h, w, b, targets)
    torch.testing.assert_close(ent.detach().cpu().double(), ent64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lp.detach().cpu().double(), lp64, rtol=1e-5, atol=1e-5)


def test_fused_backward_recomputes_the_forward_logits_bit_for_bit():
    """The gradient kernel's K blocking is the forward's (same summation order of h W^T) for every dtype and
    architecture: a last-bit difference next to a large logit offset would be a large error in the entropy
    gradient of a confident token (test_entropy_gradient_of_confident_tokens[fused])."""
    from ludic_fast.kernels import head_fwd, head_grad

    for key, config in head_grad.CONFIGS.items():
        assert config["BLOCK_K"] == head_fwd.CONFIGS[key]["BLOCK_K"], key
        assert config["BLOCK_K"] == head_fwd.SMALL_CONFIGS.get(key, config)["BLOCK_K"], key


@pytest.mark.parametrize("strategy", ["fused", "workspace"])
def test_one_column_vocabulary_gives_exact_zeros(strategy, monkeypatch):
    """V = 1: p = 1, so logprob, entropy and every gradient are exactly 0 — also at temperature 1e-3 with a
    softcap, where a recomputed logit one bit off the forward's would give O(1e-2) gradients."""
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(5, 300, generator=g), torch.randn(1, 300, generator=g) * 3e-3, torch.randn(1, generator=g))
    leaves = [x.to(DEVICE).requires_grad_() for x in raw]  # logits ~0.1: the softcap's tanh far from saturation
    out = linear_logprobs(*leaves[:2], torch.zeros(5, dtype=torch.long, device=DEVICE), bias=leaves[2],
                          temperature=1e-3, softcap=0.5, backend="triton")
    assert bool((out.logprobs == 0).all()) and bool((out.entropy == 0).all())
    grads = torch.autograd.grad((out.logprobs * 3.0 + out.entropy * 2.0).sum(), leaves)
    assert all(bool((g == 0).all()) for g in grads), [float(g.abs().max()) for g in grads]
