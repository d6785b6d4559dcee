"""The head's numerics at the edges (torch backend and the reference), against float64 computed here:

* confident tokens: fp32 entropy within 1e-3 relative where H >= 1e-5 and 1e-7 absolute below, never
  negative, at logit offsets 0, 100 and 1e3 (a bias, a large logit scale), values and gradients;
* masked vocabularies (bias = -inf): values and gradients finite and equal to the head without those columns.

Each path of the torch backend: the generic op on whole vocabulary rows and on vocabulary slices, and the
fused-loss mode on its default chunking (whole rows, `_RowEpilogue`) and on vocabulary slices."""

from __future__ import annotations

import math

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

from ludic_fast import reference as R
from ludic_fast.ops import linear_logprobs
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform

OFFSETS = [0.0, 100.0, 1e3]
SLICED = 16 * 40  # fewer than 16 whole rows of V columns: the vocabulary is sliced
PATHS = ["generic", "generic-sliced", "fused", "fused-sliced"]


def head_call(path, h, w, b, targets, g_lp, g_h, temperature=1.0):
    """(logprobs, entropy) of our head on `path`; the loss sum(g_lp lp + g_h H) is differentiable."""
    chunk = SLICED if path.endswith("sliced") else None
    if path.startswith("generic"):
        out = linear_logprobs(h, w, targets, bias=b, temperature=temperature, backend="torch", chunk_elements=chunk)
        return out.logprobs, out.entropy, (g_lp * out.logprobs + g_h * out.entropy).sum()
    transform = HeadTransform.build(1.0, None, temperature, h.shape[0], h.device)

    def objective(lp, ent, rows):
        sel = slice(None) if rows is None else rows
        return (g_lp[sel] * lp).sum() + (g_h[sel] * ent).sum()

    loss, lp, ent = fused_head_loss(h, w, b, targets, FusedPlan(transform, objective, False, True, chunk))
    return lp, ent, loss


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_entropy_of_confident_tokens(offset, path):
    h, w, b, targets = confident_rows(offset)
    ones = torch.ones(N)
    lp, ent, _ = head_call(path, h, w, b, targets, ones, ones)
    lp64, ent64 = float64_head(h, w, b, targets)
    assert_entropy_exact(ent, ent64)
    # logprobs: one rounding of the logits (|z| ~ offset) is the floor
    assert float((lp.detach().double() - lp64).abs().max()) <= 4e-7 * max(1.0, offset) + 1e-5


@pytest.mark.parametrize("offset", OFFSETS)
def test_reference_entropy_of_confident_tokens(offset):
    h, w, b, targets = confident_rows(offset)
    out = R.linear_logprobs(h, w, targets, bias=b)
    assert out.entropy.dtype == torch.float32
    assert_entropy_exact(out.entropy, float64_head(h, w, b, targets)[1])


def test_entropy_one_dominant_token_by_hand():
    """Logits 1e4 + 20 (one token) and 1e4 (49 tokens), exact in fp32: with eps = 49 e^-20,
    H = log(1 + eps) + 20 eps / (1 + eps) = 2.11e-6 (the unshifted lse - E_p z gave 0, or -9.8e-4)."""
    eps = 49 * math.exp(-20.0)
    true_h = math.log1p(eps) + 20 * eps / (1 + eps)
    bias = torch.full((50,), 1e4)
    bias[7] = 1e4 + 20
    w, h, targets = torch.zeros(50, 4), torch.randn(3, 4), torch.tensor([7, 0, 7])
    for path in PATHS:
        ent = head_call(path, h, w, bias, targets, torch.ones(3), torch.ones(3))[1]
        torch.testing.assert_close(ent.detach().double(), torch.full((3,), true_h, dtype=torch.float64),
                                   rtol=1e-5, atol=0)
    ref = R.token_entropy(bias[None, None].expand(1, 2, 50))
    torch.testing.assert_close(ref.double(), torch.full((1, 2), true_h, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_entropy_gradient_of_confident_tokens(offset, path):
    """Only confident rows (H <= 2e-2), where p_j (z_j - E_p z) cancels: the gradient of the entropy. (That of
    log p_y, g_lp (1 - p_y), still carries one rounding step of lse for a confident target: not checked here.)"""
    g = torch.Generator().manual_seed(2)
    w = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]  # orthonormal rows: h = c w_y puts z_y c above
    targets = torch.randint(0, 64, (N,), generator=g)
    h = torch.linspace(12, 25, N)[:, None] * w[targets] + 0.05 * torch.randn(N, 64, generator=g)
    b = torch.full((64,), offset) + 0.1 * torch.randn(64, generator=g)
    g_lp, g_h = torch.zeros(N), torch.randn(N, generator=g)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    _, ent, loss = head_call(path, *leaves, targets, g_lp, g_h)
    grads = torch.autograd.grad(loss, leaves)
    _, ent64, want_grads = grads64(h, w, b, targets, g_lp, g_h)
    assert float(ent64.max()) < 2e-2
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert rel_err(got, want) <= 1e-3, (name, rel_err(got, want))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logprob-grad", "logprob-and-entropy-grad"])
def test_masked_vocabulary_is_finite_and_exact(path, entropy_grad):
    h, w, b, targets, masked, keep = masked_case()
    g = torch.Generator().manual_seed(3)
    g_lp = torch.randn(N, generator=g)
    g_h = torch.randn(N, generator=g) if entropy_grad else torch.zeros(N)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    lp, ent, loss = head_call(path, *leaves, targets, g_lp, g_h, temperature=0.7)
    grads = torch.autograd.grad(loss, leaves)
    lp64, ent64, (dh64, dw64, db64) = grads64(h, w, b, targets, g_lp, g_h, keep, temperature=0.7)
    torch.testing.assert_close(lp.detach().double(), lp64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.detach().double(), ent64, rtol=1e-5, atol=1e-6)
    dh, dw, db = grads
    assert all(bool(torch.isfinite(x).all()) for x in grads)
    assert bool((dw[masked] == 0).all()) and bool((db[masked] == 0).all())
    assert rel_err(dh, dh64) <= 1e-5 and rel_err(dw, dw64) <= 1e-5 and rel_err(db, db64) <= 1e-5


def test_reference_masked_vocabulary():
    h, w, b, targets, masked, keep = masked_case(1)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    out = R.linear_logprobs(*leaves[:2], targets, bias=leaves[2])
    (out.logprobs.sum() + out.entropy.sum()).backward()
    lp64, ent64, _ = grads64(h, w, b, targets, torch.ones(N), torch.ones(N), keep)
    torch.testing.assert_close(out.entropy.double(), ent64, rtol=1e-5, atol=1e-6)
    assert all(bool(torch.isfinite(x.grad).all()) for x in leaves)
    assert bool((leaves[2].grad[masked] == 0).all())


@pytest.mark.parametrize("path", PATHS)
def test_tied_maxima(path):
    """The row maximum held by several columns (padded vocabulary rows): each tie counts e^0 = 1."""
    h, w, b, targets = tied_rows()
    lp, ent, _ = head_call(path, h, w, b, targets, torch.ones(N), torch.ones(N))
    lp64, ent64 = float64_head(h, w, b, targets)
    torch.testing.assert_close(ent.detach().double(), ent64, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lp.detach().double(), lp64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_one_column_vocabulary_gives_exact_zeros(path):
    """V = 1: p = 1, so logprob, entropy and every gradient are exactly 0 (temperature 1e-3)."""
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(5, 24, generator=g).requires_grad_(), torch.randn(1, 24, generator=g).requires_grad_(),
              torch.randn(1, generator=g).requires_grad_()]
    lp, ent, loss = head_call(path, *leaves, torch.zeros(5, dtype=torch.long), torch.full((5,), 3.0),
                              torch.full((5,), 2.0), temperature=1e-3)
    assert bool((lp == 0).all()) and bool((ent == 0).all())
    assert all(bool((x == 0).all()) for x in torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("path", PATHS)
def test_fp16_logits_beyond_fp16_range(path):
    """fp16 hidden and weight on the CPU: logits of 8e4 (past fp16's 65504) are formed in fp32, not inf/NaN."""
    g = torch.Generator().manual_seed(0)
    h = (20 + torch.rand(6, 8, generator=g)).half()
    w = (400 + 100 * torch.rand(5, 8, generator=g)).half()
    targets = torch.tensor([0, 1, 2, 3, 4, 0])
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), torch.zeros(5, requires_grad=True)]
    lp, ent, loss = head_call(path, *leaves, targets, torch.ones(6), torch.ones(6))
    lp64, ent64 = float64_head(h, w, torch.zeros(5), targets)
    assert float((h.double() @ w.double().T).max()) > 65504
    torch.testing.assert_close(lp.detach().double(), lp64, rtol=1e-5, atol=1e-2)  # |z| ~ 1e5: ulp(z) ~ 1e-2
    torch.testing.assert_close(ent.detach().double(), ent64, rtol=1e-3, atol=1e-3)
    assert all(bool(torch.isfinite(x).all()) for x in torch.autograd.grad(loss, leaves))

