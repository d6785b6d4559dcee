"""The fused-loss op treats rows whose target is ignore_index (-100) like `linear_logprobs` does:
lp = H = 0 there and no gradient flows from them, whatever the objective does with those rows."""

from __future__ import annotations

import pytest
import torch

import ludic_fast
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform


@pytest.mark.parametrize("coupled", [False, True])
def test_ignored_rows_match_linear_logprobs(coupled):
    g = torch.Generator().manual_seed(0)
    n, D, V = 23, 16, 301
    h = torch.randn(n, D, generator=g, requires_grad=True)
    W = torch.randn(V, D, generator=g, requires_grad=True)
    y = torch.randint(0, V, (n,), generator=g)
    y[[0, 5, 22]] = -100
    a, c = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def objective(lp, H, rows):  # reads every row, ignored ones included
        sel = slice(None) if rows is None else rows
        return (a[sel] * lp).sum() + (c[sel] * H * lp.detach().exp()).sum()

    plan = FusedPlan(HeadTransform.build(1.0, None, 0.8, n, h.device), objective, coupled, True, 5 * V)
    loss, lp, H = fused_head_loss(h, W, None, y, plan)
    g_fused = torch.autograd.grad(loss, (h, W))

    out = ludic_fast.linear_logprobs(h, W, y, temperature=0.8)
    ref_loss = objective(out.logprobs, out.entropy, None)
    g_ref = torch.autograd.grad(ref_loss, (h, W))

    assert bool((lp[[0, 5, 22]] == 0).all()) and bool((H[[0, 5, 22]] == 0).all())
    torch.testing.assert_close(lp, out.logprobs.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(g_fused, g_ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("coupled,chunk_elements,calls", [(False, None, 1), (True, None, 1), (False, 5 * 301, 3)],
                         ids=["token-local-one-chunk", "coupled-two-pass", "token-local-two-chunks"])
def test_objective_runs_once_when_one_call_covers_every_token(coupled, chunk_elements, calls):
    """The loss is the value of the objective's gradient call when that call saw every token (one token chunk,
    or a coupled loss's all-token pass): no second host-side evaluation. Two chunks: one call per chunk plus
    the value on all tokens. The loss equals the objective at the returned (lp, H) bit for bit either way."""
    g = torch.Generator().manual_seed(1)
    n, D, V = 23, 16, 301
    h = torch.randn(n, D, generator=g, requires_grad=True)
    W = torch.randn(V, D, generator=g, requires_grad=True)
    y = torch.randint(0, V, (n,), generator=g)
    a = torch.randn(n, generator=g)
    seen = []

    def objective(lp, H, rows):
        seen.append(rows)
        sel = slice(None) if rows is None else rows
        return (a[sel] * lp).sum() + 0.1 * (torch.softmax(lp, 0) * H).sum() if coupled else (a[sel] * lp).sum()

    plan = FusedPlan(HeadTransform.build(1.0, None, 1.0, n, h.device), objective, coupled, True, chunk_elements)
    loss, lp, H = fused_head_loss(h, W, None, y, plan)
    assert len(seen) == calls and seen.count(None) == 1, seen  # all tokens once: what the losses' stats read
    assert torch.equal(loss, objective(lp, H, None).detach())
    out = ludic_fast.linear_logprobs(h, W, y, entropy=True)
    for got, want in zip(torch.autograd.grad(loss, (h, W)),
                         torch.autograd.grad(objective(out.logprobs, out.entropy, None), (h, W))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
