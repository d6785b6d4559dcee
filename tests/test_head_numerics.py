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

from ludic_fast import reference as R
from ludic_fast.ops import linear_logprobs
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform

N, D, V = 48, 16, 257
OFFSETS = [0.0, 100.0, 1e3]
SLICED = 16 * 40  # fewer than 16 whole rows of V columns: the vocabulary is sliced
PATHS = ["generic", "generic-sliced", "fused", "fused-sliced"]


def float64_head(h, w, b, targets, temperature=1.0):
    """(logprob, entropy) of `(h W^T + b) / T` in float64 with 0 log 0 = 0 — independent of the library."""
    z = (h.double() @ w.double().T + b.double()) / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros((), dtype=torch.float64))).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), ent


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


def confident_rows(offset: float, seed: int = 0):
    """Rows from nearly uniform to one token with all the mass (H from ~1 down to ~1e-12), logits near
    `offset` (a common bias)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g) * torch.logspace(-1, 0.9, N)[:, None]
    w = torch.randn(V, D, generator=g)
    b = torch.full((V,), offset) + 0.1 * torch.randn(V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    return h, w, b, targets


def assert_entropy_exact(ent, ent64):
    ent = ent.detach().double()
    assert bool((ent >= 0).all()), "negative entropy"
    big = ent64 >= 1e-5
    assert big.any() and (~big).any(), "the rows must span both regimes"
    rel = ((ent - ent64).abs() / ent64)[big].max()
    small = (ent - ent64).abs()[~big].max()
    assert rel <= 1e-3 and small <= 1e-7, (float(rel), float(small))


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


def _grads64(h, w, b, targets, g_lp, g_h, keep=None, temperature=1.0):
    """float64 autograd of sum(g_lp lp + g_h H) w.r.t. (h, w, b), on the columns `keep` only (None: all)."""
    x = [t.detach().double().requires_grad_() for t in (h, w, b)]
    hd, wd, bd = x
    cols = torch.arange(w.shape[0]) if keep is None else keep
    remap = torch.full((w.shape[0],), -1, dtype=torch.long)
    remap[cols] = torch.arange(cols.numel())
    lp, ent = float64_head(hd, wd[cols], bd[cols], remap[targets], temperature)
    (g_lp.double() * lp + g_h.double() * ent).sum().backward()
    return lp.detach(), ent.detach(), [t.grad for t in x]


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30))


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
    _, ent64, grads64 = _grads64(h, w, b, targets, g_lp, g_h)
    assert float(ent64.max()) < 2e-2
    for name, got, want in zip(("hidden", "weight", "bias"), grads, grads64):
        assert _rel(got, want) <= 1e-3, (name, _rel(got, want))


def masked_case(seed: int = 0):
    """Every third column and the last 40 masked by a bias of -inf; targets on unmasked columns."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g)
    masked = torch.zeros(V, dtype=torch.bool)
    masked[::3] = True
    masked[-40:] = True
    b[masked] = float("-inf")
    keep = (~masked).nonzero().squeeze(1)
    targets = keep[torch.randint(0, keep.numel(), (N,), generator=g)]
    return h, w, b, targets, masked, keep


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
    lp64, ent64, (dh64, dw64, db64) = _grads64(h, w, b, targets, g_lp, g_h, keep, temperature=0.7)
    torch.testing.assert_close(lp.detach().double(), lp64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.detach().double(), ent64, rtol=1e-5, atol=1e-6)
    dh, dw, db = grads
    assert all(bool(torch.isfinite(x).all()) for x in grads)
    assert bool((dw[masked] == 0).all()) and bool((db[masked] == 0).all())
    assert _rel(dh, dh64) <= 1e-5 and _rel(dw, dw64) <= 1e-5 and _rel(db, db64) <= 1e-5


def test_reference_masked_vocabulary():
    h, w, b, targets, masked, keep = masked_case(1)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    out = R.linear_logprobs(*leaves[:2], targets, bias=leaves[2])
    (out.logprobs.sum() + out.entropy.sum()).backward()
    lp64, ent64, _ = _grads64(h, w, b, targets, torch.ones(N), torch.ones(N), keep)
    torch.testing.assert_close(out.entropy.double(), ent64, rtol=1e-5, atol=1e-6)
    assert all(bool(torch.isfinite(x.grad).all()) for x in leaves)
    assert bool((leaves[2].grad[masked] == 0).all())
