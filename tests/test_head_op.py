"""The head op on the torch backend against `ludic_fast.reference` (materialised logits)."""

from __future__ import annotations

import pytest
import torch

import ludic_fast
from ludic_fast import reference

IGNORE = -100


def _case(N, D, V, dtype=torch.float32, seed=0, ignore_rows=(), bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype)
    W = (torch.randn(V, D, generator=g) / D**0.5 * 2).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    for r in ignore_rows:
        if r < N:
            y[r] = IGNORE
    return h, W, b, y


def _close(actual, expected, rtol):
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.abs().max().clamp(min=1.0)) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def _run(fn, h, W, b, y, g_lp, g_H, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (h, W) + ((b,) if b is not None else ())]
    out = fn(leaves[0], leaves[1], y, bias=leaves[2] if b is not None else None, **kw)
    loss = 0.0
    if g_lp is not None:
        loss = loss + (out.logprobs * g_lp).sum()
    if g_H is not None:
        loss = loss + (out.entropy * g_H).sum()
    grads = torch.autograd.grad(loss, leaves) if isinstance(loss, torch.Tensor) else None
    return out, grads


# T = 1 takes the transform's unit-temperature branch; any other T, scalar or per token, the per-row 1/T one
# (a scalar fills the per-token tensor): per_token covers it; scalar T = 0.7 in test_each_upstream_gradient_alone
# and test_memory_budget_sets_the_chunks
TEMPS = {"T1": 1.0, "per_token": "per_token"}


@pytest.mark.parametrize("V,chunk", [(1021, None), (1021, 37 * 16), (4099, 999), (50257, 16 * 4000)])
@pytest.mark.parametrize("temp", list(TEMPS))
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_matches_reference_fp32(V, chunk, temp, softcap):
    N, D = 53, 40
    h, W, b, y = _case(N, D, V, ignore_rows=(0, 17))
    T = torch.rand(N, generator=torch.Generator().manual_seed(1)) + 0.5 if temp == "per_token" else TEMPS[temp]
    kw = dict(temperature=T, softcap=softcap, logit_scale=0.8)
    g = torch.Generator().manual_seed(2)
    g_lp, g_H = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ours, g_ours = _run(ludic_fast.linear_logprobs, h, W, b, y, g_lp, g_H, chunk_elements=chunk, **kw)
    ref, g_ref = _run(reference.linear_logprobs, h, W, b, y, g_lp, g_H, **kw)
    _close(ours.logprobs, ref.logprobs, 1e-5)
    _close(ours.entropy, ref.entropy, 1e-5)
    _close(ours.lse, ref.lse, 1e-5)
    assert ours.logprobs.dtype == torch.float32 and ours.entropy.dtype == torch.float32
    assert bool((ours.logprobs[[0, 17]] == 0).all()) and bool((ours.entropy[[0, 17]] == 0).all())
    for a, e in zip(g_ours, g_ref):
        _close(a, e, 1e-5)


@pytest.mark.parametrize("which", ["logprob_only", "entropy_only"])
def test_each_upstream_gradient_alone(which):
    N, D, V = 29, 24, 1021
    h, W, b, y = _case(N, D, V, ignore_rows=(3,))
    g = torch.Generator().manual_seed(5)
    g_lp = torch.randn(N, generator=g) if which == "logprob_only" else None
    g_H = torch.randn(N, generator=g) if which == "entropy_only" else None
    _, g_ours = _run(ludic_fast.linear_logprobs, h, W, b, y, g_lp, g_H, chunk_elements=8 * 300, temperature=0.7)
    _, g_ref = _run(reference.linear_logprobs, h, W, b, y, g_lp, g_H, temperature=0.7)
    for a, e in zip(g_ours, g_ref):
        _close(a, e, 1e-5)


def test_entropy_false_returns_none_and_same_logprobs():
    h, W, b, y = _case(11, 16, 1021)
    out = ludic_fast.linear_logprobs(h, W, y, bias=b, entropy=False)
    ref = reference.linear_logprobs(h, W, y, bias=b)
    assert out.entropy is None
    _close(out.logprobs, ref.logprobs, 1e-5)


def test_bf16_within_documented_tolerance():
    """bf16 GEMM inputs, fp32 statistics: logprob/entropy within 2e-2 abs of the fp32 reference on the same
    (bf16-rounded) inputs; gradients within 3e-2 relative to their max."""
    N, D, V = 64, 64, 4099
    h, W, b, y = _case(N, D, V, dtype=torch.bfloat16, ignore_rows=(1,))
    g = torch.Generator().manual_seed(3)
    g_lp, g_H = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ours, g_ours = _run(ludic_fast.linear_logprobs, h, W, b, y, g_lp, g_H, chunk_elements=16 * 1000)
    ref, g_ref = _run(reference.linear_logprobs, h, W, b, y, g_lp, g_H)
    assert ours.logprobs.dtype == torch.float32
    torch.testing.assert_close(ours.logprobs, ref.logprobs, rtol=0, atol=2e-2)
    torch.testing.assert_close(ours.entropy, ref.entropy, rtol=0, atol=2e-2)
    for a, e in zip(g_ours, g_ref):
        assert a.dtype == torch.bfloat16
        assert float((a.float() - e.float()).abs().max()) <= 3e-2 * float(e.float().abs().max())


@pytest.mark.parametrize("N", [0, 1, 300])
def test_token_counts(N):
    h, W, b, y = _case(N, 32, 1021)
    ours = ludic_fast.linear_logprobs(h, W, y, bias=b, chunk_elements=64 * 1021)
    ref = reference.linear_logprobs(h, W, y, bias=b)
    assert ours.logprobs.shape == (N,)
    if N:
        _close(ours.logprobs, ref.logprobs, 1e-5)
        _close(ours.entropy, ref.entropy, 1e-5)


def test_batched_shapes_and_strided_inputs():
    """hidden [B, T, D] as a non-contiguous view, weight as a strided slice, targets transposed."""
    B, T, D, V = 3, 7, 24, 1021
    g = torch.Generator().manual_seed(9)
    h_big = torch.randn(T, B, 2 * D, generator=g)
    h = h_big[..., ::2].transpose(0, 1)  # [B, T, D], non-contiguous
    W = torch.randn(2 * V, D, generator=g)[::2]
    y = torch.randint(0, V, (T, B), generator=g).T
    T_tok = torch.rand(T, B, generator=g).T + 0.5
    assert not h.is_contiguous() and not W.is_contiguous() and not y.is_contiguous()
    g_lp = torch.randn(T, B, generator=g).T  # strided upstream gradients
    g_H = torch.randn(T, B, generator=g).T
    ours, g_ours = _run(ludic_fast.linear_logprobs, h, W, None, y, g_lp, g_H, temperature=T_tok, chunk_elements=5000)
    ref, g_ref = _run(reference.linear_logprobs, h, W, None, y, g_lp, g_H, temperature=T_tok)
    assert ours.logprobs.shape == (B, T)
    _close(ours.logprobs, ref.logprobs, 1e-5)
    _close(ours.entropy, ref.entropy, 1e-5)
    for a, e in zip(g_ours, g_ref):
        _close(a, e, 1e-5)


def test_float64_finite_differences():
    N, D, V = 4, 5, 13
    h, W, b, y = _case(N, D, V, dtype=torch.float64, ignore_rows=(2,))
    T = torch.tensor([0.7, 1.3, 1.0, 0.9], dtype=torch.float64)

    def f(h_, W_, b_):
        out = ludic_fast.linear_logprobs(h_, W_, y, bias=b_, temperature=T, softcap=3.0, chunk_elements=2 * 5)
        return out.logprobs, out.entropy

    inputs = tuple(t.clone().requires_grad_() for t in (h, W, b))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_cross_entropy(reduction):
    h, W, b, y = _case(40, 16, 1021, ignore_rows=(0, 5, 9))
    ours = ludic_fast.linear_cross_entropy(h, W, y, bias=b, reduction=reduction, chunk_elements=3000)
    ref = reference.linear_cross_entropy(h, W, y, bias=b, reduction=reduction)
    _close(ours, ref, 1e-5)


def test_all_ignored_gives_zeros_and_zero_grads():
    h, W, b, y = _case(6, 8, 101)
    y[:] = IGNORE
    out, grads = _run(ludic_fast.linear_logprobs, h, W, b, y, torch.ones(6), torch.ones(6))
    assert bool((out.logprobs == 0).all()) and bool((out.entropy == 0).all())
    assert all(bool((g == 0).all()) for g in grads)


def test_nan_in_hidden_propagates():
    h, W, b, y = _case(5, 8, 101)
    h[2, 3] = float("nan")
    out, grads = _run(ludic_fast.linear_logprobs, h, W, b, y, torch.ones(5), torch.ones(5))
    assert bool(out.logprobs[2].isnan()) and bool(out.entropy[2].isnan())
    assert bool(out.logprobs[[0, 1, 3, 4]].isfinite().all())
    assert bool(grads[1].isnan().any())  # dW sees the NaN row: not silently zeroed


@pytest.mark.parametrize("budget,blocks", [(240_000, (16, 355)), (183_840, (16, 62)), (400_000, (18, 1021)),
                                           ("1GiB", (53, 1021))])
def test_memory_budget_sets_the_chunks(budget, blocks):
    """On the CPU a byte budget holds the fp32 dh and dW (4 (N + V) D = 171840 bytes here) plus chunks of 12
    bytes per logit element: 240000 bytes -> 5680 elements: fewer than 16 whole rows, so 16 tokens x 355
    columns; 183840 -> 1000 elements -> 16 x 62; 400000 -> 19013 elements -> 18 whole rows. Same numbers as
    the reference either way."""
    from ludic_fast.ops.plan import plan_head

    N, D, V = 53, 40, 1021
    assert plan_head(N, D, V, dtype=torch.float32, device="cpu", backend="torch", memory_budget=budget).blocks == blocks
    h, W, b, y = _case(N, D, V, ignore_rows=(3,))
    g = torch.Generator().manual_seed(2)
    g_lp, g_H = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ours, g_ours = _run(ludic_fast.linear_logprobs, h, W, b, y, g_lp, g_H, memory_budget=budget, temperature=0.7)
    ref, g_ref = _run(reference.linear_logprobs, h, W, b, y, g_lp, g_H, temperature=0.7)
    _close(ours.logprobs, ref.logprobs, 1e-5)
    _close(ours.entropy, ref.entropy, 1e-5)
    for a, e in zip(g_ours, g_ref):
        _close(a, e, 1e-5)
    ce = ludic_fast.linear_cross_entropy(h, W, y, bias=b, memory_budget=budget)
    _close(ce, torch.nn.functional.cross_entropy(reference.head_logits(h, W, b), y, ignore_index=IGNORE), 1e-5)
