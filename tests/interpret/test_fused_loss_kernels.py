"""The fused-loss mode on the triton backend (GEMM + row kernel, d(raw) written in the operand dtype over the
fp32 workspace or into the dW staging buffer) against the reference, with low-precision inputs: one token
chunk (dh and dW written once in the input dtype), several chunks each with its own dW GEMM (fp32 dW, the
first with beta = 0), chunks staged into groups (two groups: fp32 dW; one group: dW in the input dtype), a
token-local objective with logprob and entropy terms, a coupled one (two passes), and a grad_output that is
not 1. The fused (tl.dot) strategy runs the same cases: statistics by the tl.dot forward, d(raw) recomputed
by the tl.dot gradient kernel into a buffer of the input dtype (no fp32 workspace); and with its TMA variant
(LUDIC_FAST_TMA=1: descriptors built for bf16/fp16, none for fp32)."""

from __future__ import annotations

import pytest
import torch
from _interp import DEVICE, MARKS, SM90

from ludic_fast import reference
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform

pytestmark = MARKS

N, V, D = 40, 1021, 40


def _record_schedule(monkeypatch, chunk_cls: str = "_TritonRows") -> list[tuple[bool, int]]:
    """(d(raw) staged, number of dW groups) of every triton chunk backward of `chunk_cls` from now on."""
    from ludic_fast.ops import fused_loss

    calls = []
    cls = getattr(fused_loss, chunk_cls)
    backward = cls.backward_

    def spy(self, *args):
        calls.append((self.stage.out(self.rows) is not None, len(self.stage.groups)))
        return backward(self, *args)

    monkeypatch.setattr(cls, "backward_", spy)
    return calls


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.4).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[3::5] = -100
    inv_t = (torch.rand(N, generator=g) + 0.5).double()
    coef = torch.randn(N, generator=g)
    return h, w, targets, inv_t, coef


def _objective(coef, coupled):
    """Token-local: sum_t c_t lp_t + 0.1 sum_t c_t^2 H_t. Coupled: a per-batch softmax over lp couples tokens."""

    def token_local(lp, H, rows):
        c = coef if rows is None else coef[rows]
        return (c * lp).sum() + 0.1 * (c * c * H).sum()

    def coupled_fn(lp, H, rows):
        return (torch.softmax(lp, 0) * coef).sum() + 0.1 * H.sum()

    return coupled_fn if coupled else token_local


# the coupled objective (two passes over the chunks) differs from the token-local one in fused_loss's Python
# only (stats of every chunk first, then each chunk's backward_), not in the kernels or buffers a dtype reaches:
# it runs in bf16 and fp32; fp16 (bf16's 2-byte path in another format) runs every schedule token-local
DTYPE_OBJECTIVE = [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.bfloat16, True),
                   (torch.float32, True)]


@pytest.mark.parametrize(("dtype", "coupled"), DTYPE_OBJECTIVE,
                         ids=[f"{str(d)[6:]}-{'coupled' if c else 'token-local'}" for d, c in DTYPE_OBJECTIVE])
@pytest.mark.parametrize(
    "strategy,chunk_elements,stage_rows,staged,groups",
    [
        ("workspace", None, None, False, 1),
        ("workspace", 16 * V, None, False, 3),
        ("workspace", 16 * V, 32, True, 2),
        ("workspace", 16 * V, 40, True, 1),
        ("fused", None, None, False, 1),
        ("fused", 16 * V, None, False, 3),
        ("fused-tma", 16 * V, None, False, 3),
    ],
    ids=["one-chunk", "three-chunks", "staged-two-groups", "staged-one-group", "tl-dot-one-chunk",
         "tl-dot-three-chunks", "tl-dot-tma-three-chunks"],
)
def test_fused_loss_triton_matches_reference(
    dtype, strategy, chunk_elements, stage_rows, staged, groups, coupled, monkeypatch
):
    from ludic_fast.kernels import head_fwd

    strategy, tma = strategy.removesuffix("-tma"), strategy.endswith("-tma")
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    monkeypatch.setenv("LUDIC_FAST_TMA", "1" if tma else "0")
    calls = _record_schedule(monkeypatch, "_TritonDotRows" if strategy == "fused" else "_TritonRows")
    descriptors = []
    monkeypatch.setattr(head_fwd, "descriptor", lambda t, block, make=head_fwd.descriptor: descriptors.append(block)
                        or make(t, block))
    h, w, targets, inv_t, coef = _inputs(dtype)
    objective = _objective(coef.to(DEVICE), coupled)
    transform = HeadTransform(1.0, None, inv_t.to(DEVICE))
    plan = FusedPlan(transform, objective, coupled=coupled, with_entropy=True, chunk_elements=chunk_elements,
                     backend="triton", dw_stage_rows=stage_rows)
    hd, wd = (x.to(DEVICE).requires_grad_() for x in (h, w))
    loss, lp, H = fused_head_loss(hd, wd, None, targets.to(DEVICE), plan)
    grad_out = torch.tensor(0.3, device=DEVICE)  # not a power of two: the stored gradients are rescaled
    dh, dw = torch.autograd.grad(loss, (hd, wd), grad_out)
    assert calls == [(staged, groups)] * (1 if chunk_elements is None else 3), "not the expected triton schedule"
    # TMA: h and W descriptors for the forward and the gradient kernel of each of the 3 chunks (not for fp32)
    assert len(descriptors) == (3 * 4 if tma and SM90 and dtype != torch.float32 else 0), descriptors

    hr, wr = (x.float().requires_grad_() for x in (h, w))
    ref = reference.linear_logprobs(hr, wr, targets, temperature=inv_t.reciprocal().float())
    ref_loss = _objective(coef, coupled)(ref.logprobs, ref.entropy, None)
    ref_dh, ref_dw = torch.autograd.grad(ref_loss, (hr, wr), torch.tensor(0.3))

    torch.testing.assert_close(lp.cpu(), ref.logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(H.cpu(), ref.entropy, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=1e-4, rtol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2  # d(raw) and the gradients are rounded to the input dtype
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert got.dtype == dtype and got.shape == want.shape
        err = ((got.float().cpu() - want).abs().max() / want.abs().max()).item()
        assert err <= tol, err


def test_memory_budget_plans_dw_staging(monkeypatch):
    """150000 bytes (bf16, N=40, V=1021, D=40): one 40-row chunk needs 163360 bytes of fp32 workspace and
    several chunks an fp32 dW of 163360 more, so the plan takes 14-row chunks (57176 bytes) staging all 40
    rows' d(raw) in bf16 (81680 bytes) for a single dW GEMM; the triton path follows it. (Workspace strategy
    forced: the fused strategy's bf16 d(raw) buffer of all 40 rows fits on its own.) The CPU preset of the cost
    model is pinned, so on CUDA too (whose 128-row alignment fits nothing here: tests/test_plan.py) the same
    plan runs."""
    from ludic_fast.ops.plan import plan_head

    budget = 150_000
    monkeypatch.setenv("LUDIC_FAST_DEVICE_MODEL", "cpu")
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", "workspace")
    plan_ = plan_head(N, D, V, dtype=torch.bfloat16, mode="fused_loss", device=DEVICE, memory_budget=budget,
                      strategy="workspace")
    assert (plan_.token_rows, plan_.stage_rows, plan_.fits) == (14, 40, True)
    calls = _record_schedule(monkeypatch)
    h, w, targets, inv_t, coef = _inputs(torch.bfloat16)
    transform = HeadTransform(1.0, None, inv_t.to(DEVICE))
    plan = FusedPlan(transform, _objective(coef.to(DEVICE), False), coupled=False, with_entropy=True,
                     backend="triton", memory_budget=budget)
    hd, wd = (x.to(DEVICE).requires_grad_() for x in (h, w))
    loss, lp, H = fused_head_loss(hd, wd, None, targets.to(DEVICE), plan)
    dh, dw = torch.autograd.grad(loss, (hd, wd))
    assert calls == [(True, 1)] * 3
    hr, wr = (x.float().requires_grad_() for x in (h, w))
    ref = reference.linear_logprobs(hr, wr, targets, temperature=inv_t.reciprocal().float())
    ref_loss = _objective(coef, False)(ref.logprobs, ref.entropy, None)
    ref_dh, ref_dw = torch.autograd.grad(ref_loss, (hr, wr))
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=1e-4, rtol=1e-5)
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert ((got.float().cpu() - want).abs().max() / want.abs().max()).item() <= 1.5e-2


@pytest.mark.parametrize("strategy", ["workspace", "fused"])
@pytest.mark.parametrize("grad_out", [1.0, 0.3], ids=["g=1", "g=0.3"])
def test_one_chunk_dw_written_once_in_backward(strategy, grad_out, monkeypatch):
    """One token chunk whose d(raw) buffer is smaller than dW (bf16, n=12 rows against D=64): the backward forms
    dW = d(raw)^T (g h) with one GEMM that writes it in bf16, and no other op touches a [V, D] tensor (before,
    the forward wrote dW and the backward rescaled it in place: a read-modify-write pass over [V, D])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    n, d = 12, 64
    g = torch.Generator().manual_seed(3)
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, d, generator=g) * 0.3).to(torch.bfloat16)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[5] = -100
    inv_t = (torch.rand(n, generator=g) + 0.5).double()
    coef = torch.randn(n, generator=g)
    plan = FusedPlan(HeadTransform(1.0, None, inv_t.to(DEVICE)), _objective(coef.to(DEVICE), False), coupled=False,
                     with_entropy=True, backend="triton")
    hd, wd = (x.to(DEVICE).requires_grad_() for x in (h, w))
    loss, _, _ = fused_head_loss(hd, wd, None, targets.to(DEVICE), plan)

    class VdOps(TorchDispatchMode):
        """Names of the ops with a [V, D] tensor among their arguments or results."""

        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,))]
            if any(isinstance(t, torch.Tensor) and tuple(t.shape) in ((V, d), (d, V)) for t in flat):
                self.names.append(func.overloadpacket.__name__)
            return out

    ops = VdOps()
    with ops:
        dh, dw = torch.autograd.grad(loss, (hd, wd), torch.tensor(grad_out, device=DEVICE))
    assert [o for o in ops.names if o not in ("empty", "empty_strided", "t", "transpose", "detach", "alias")] \
        == ["mm"], ops.names
    hr, wr = (x.float().requires_grad_() for x in (h, w))
    ref = reference.linear_logprobs(hr, wr, targets, temperature=inv_t.reciprocal().float())
    ref_dh, ref_dw = torch.autograd.grad(_objective(coef, False)(ref.logprobs, ref.entropy, None), (hr, wr),
                                         torch.tensor(grad_out))
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert ((got.float().cpu() - want).abs().max() / want.abs().max()).item() <= 1.5e-2
