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


def dominant_token_rows():
    """Logits exact in fp32 (W = 0, bias only): 1e4 + g at the target, 1e4 at the 49 other tokens, g = 28, 32,
    36 per row. With eps = 49 e^-g, H = log(1 + eps) + g eps / (1 + eps): from 9.8e-10 down to 4.2e-13, where
    log(1 + eps) in fp32 (1 + eps rounds to 1) would lose the first term: an error of 1 / (g + 1) of H."""
    gaps = torch.tensor([28.0, 32.0, 36.0], dtype=torch.float64)
    eps = 49 * torch.exp(-gaps)
    want = torch.log1p(eps) + gaps * eps / (1 + eps)
    targets = torch.tensor([7, 0, 49])
    b = torch.full((3, 50), 1e4).scatter_add(1, targets[:, None], gaps.float()[:, None])
    return b, targets, want


@pytest.mark.parametrize("route", ROUTES)
def test_entropy_one_dominant_token_exact(route, monkeypatch):
    """The exact dominant-token case on every head route: relative error at fp32 rounding, H ~1e-9..1e-12."""
    b, targets, want = dominant_token_rows()
    for row in range(3):  # one bias per row: W = 0, so every row of a call has the same logits
        h, w = torch.randn(3, 4, generator=torch.Generator().manual_seed(row)), torch.zeros(50, 4)
        t = targets[row].expand(3)
        ent = triton_call(route, monkeypatch, h, w, b[row], t, torch.ones(3), torch.ones(3))[1]
        torch.testing.assert_close(ent.detach().cpu().double(), want[row].expand(3), rtol=1e-5, atol=0)


def test_entropy_one_dominant_token_exact_in_the_divergence_kernel():
    """`linear_divergence(..., return_entropy=True)` on the Triton row kernel: the same exact entropies."""
    from ludic_fast import linear_divergence

    b, targets, want = dominant_token_rows()
    eye = torch.eye(50, device=DEVICE)  # hidden = the logits, W = identity
    uniform = torch.full((3, 50), 1.0 / 50, device=DEVICE)
    _, ent = linear_divergence(b.to(DEVICE), eye, teacher_probs=uniform, return_entropy=True, backend="triton")
    torch.testing.assert_close(ent.cpu().double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("route", ROUTES)
def test_target_id_zero_gets_its_logprob_gradient(route, monkeypatch):
    """Rows whose target is token id 0 (the first column): the log-prob and entropy gradients as float64's."""
    g = torch.Generator().manual_seed(4)
    h, w, b = torch.randn(6, 8, generator=g), torch.randn(40, 8, generator=g) * 0.5, torch.randn(40, generator=g)
    targets = torch.tensor([0, 5, 0, 39, 0, 17])
    g_lp, g_h = torch.randn(6, generator=g), torch.randn(6, generator=g)
    leaves = [x.clone().to(DEVICE).requires_grad_() for x in (h, w, b)]
    lp, _, loss = triton_call(route, monkeypatch, *leaves, targets, g_lp, g_h)
    grads = [x.cpu() for x in torch.autograd.grad(loss, leaves)]
    lp64, _, want = grads64(h, w, b, targets, g_lp, g_h)
    torch.testing.assert_close(lp.detach().cpu().double(), lp64, rtol=1e-5, atol=1e-5)
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
        assert rel_err(got, ref) <= 1e-5, (name, rel_err(got, ref))
