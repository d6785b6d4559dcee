"""Triton head kernels (fused and workspace strategies) under TRITON_INTERPRET=1 vs ludic_fast.reference.

Cases are a hand-picked cover of dtype x V x D x temperature x softcap x bias x ignore_index x strides x N
(not the full cross-product: the interpreter is slow). D is never a multiple of the K block (32).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _head_grads import head_and_grads
from _interp import DEVICE, MARKS, SM90

from ludic_fast import reference
from ludic_fast.ops import linear_logprobs

pytestmark = MARKS


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    n: int
    v: int
    d: int
    temperature: str  # "1", "0.7" or "per-token"
    softcap: float | None = None
    logit_scale: float = 1.0
    bias: bool = False
    entropy: bool = True
    ignore: bool = False  # some rows are ignore_index
    strided: bool = False  # hidden / weight non-contiguous


CASES = [
    Case("fp32-v1021-n3", torch.float32, 3, 1021, 40, "1", bias=True, ignore=True),
    # 5 row tiles of 64 (a partial last one), so the fused forward's 33 vocab blocks go in splits of 2 (132 programs)
    Case("fp32-v4099-n260", torch.float32, 260, 4099, 72, "per-token", softcap=5.0, logit_scale=1.3, bias=True,
         ignore=True, strided=True),
    Case("fp32-v4099-n1", torch.float32, 1, 4099, 40, "0.7", softcap=3.0, entropy=False),
    Case("bf16-v1021-n3", torch.bfloat16, 3, 1021, 40, "0.7", softcap=5.0, bias=True, strided=True),
    # above SMALL_N: two row tiles of 128, the second partial
    Case("bf16-v4099-n130", torch.bfloat16, 130, 4099, 40, "per-token", ignore=True),
    Case("bf16-v1021-n1", torch.bfloat16, 1, 1021, 72, "1", logit_scale=0.5, entropy=False),
    Case("fp16-v1021-n3", torch.float16, 3, 1021, 40, "0.7", softcap=5.0, bias=True, ignore=True),
]


def _inputs(case: Case, seed: int = 0, device: str = DEVICE):
    """Every input of one case on `device` (drawn on the CPU generator, then moved; strided views are taken
    on `device`, since moving a non-dense view makes it contiguous)."""
    g = torch.Generator().manual_seed(seed)
    n, v, d = case.n, case.v, case.d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(case.dtype).to(device)

    if case.strided:
        hidden = rnd(n, 2 * d)[:, ::2]
        weight = rnd(d, v, scale=0.4).T  # [V, D] column-major
    else:
        hidden = rnd(n, d)
        weight = rnd(v, d, scale=0.4)
    bias = (torch.randn(v, generator=g) * 0.5).to(case.dtype).to(device) if case.bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if case.ignore:
        targets[1::7] = -100
    temperature = {"1": 1.0, "0.7": 0.7, "per-token": torch.rand(n, generator=g) + 0.4}[case.temperature]
    g_lp = torch.randn(n, 3, generator=g).to(device)[:, 1]  # strided upstream gradients
    g_h = torch.randn(2, n, generator=g).to(device)[1, :] if case.entropy else None
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device)
    return hidden, weight, bias, targets.to(device), temperature, g_lp, g_h


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _max_rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("strategy", ["fused", "workspace"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_head_matches_reference(case, strategy, monkeypatch):
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    hidden, weight, bias, targets, temperature, g_lp, g_h = _inputs(case)
    assert hidden.is_contiguous() != case.strided and weight.is_contiguous() != case.strided

    def triton_fn(*a, **k):
        return linear_logprobs(*a, backend="triton", **k)

    out, grads = head_and_grads(triton_fn, case, hidden, weight, bias, targets, temperature, g_lp, g_h)
    # the reference runs in fp32 on the CPU, on the exact fp32 images of the (possibly bf16) inputs
    f32 = [None if x is None else x.float().cpu() for x in (hidden, weight, bias)]
    targets, temperature, g_lp, g_h = (_cpu(x) for x in (targets, temperature, g_lp, g_h))
    ref, ref_grads = head_and_grads(reference.linear_logprobs, case, *f32, targets, temperature, g_lp, g_h)

    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == targets.shape
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.lse.cpu(), ref.lse, atol=2e-5, rtol=1e-5)
    if case.entropy:
        torch.testing.assert_close(out.entropy.cpu(), ref.entropy, atol=2e-5, rtol=1e-5)
    else:
        assert out.entropy is None
    assert bool((out.logprobs.cpu()[targets == -100] == 0).all())
    # bf16/fp16: d(raw) is rounded to the input dtype before the gradient GEMMs (tensor-core operands), as verl/CCE do
    grad_tol = 1e-5 if case.dtype == torch.float32 else 1.5e-2
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == case.dtype and got.shape == want.shape, name
        assert _max_rel(got.cpu(), want) <= grad_tol, (name, _max_rel(got.cpu(), want))


@pytest.mark.parametrize("strategy", ["fused", "workspace"])
def test_only_entropy_gradient_and_frozen_weight(strategy, monkeypatch):
    """g_lp absent (None upstream) and no weight grad requested: dh from the entropy term alone."""
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    case = Case("fp32", torch.float32, 5, 1021, 40, "0.7", softcap=4.0)
    hidden, weight, _, targets, temperature, _, g_h = _inputs(case, seed=3)
    h = hidden.clone().requires_grad_()
    out = linear_logprobs(h, weight, targets, temperature=temperature, softcap=4.0, backend="triton")
    (dh,) = torch.autograd.grad(out.entropy, h, g_h)
    h_ref = hidden.cpu().requires_grad_()
    ref = reference.linear_logprobs(h_ref, weight.cpu(), targets.cpu(), temperature=temperature.cpu()
                                    if isinstance(temperature, torch.Tensor) else temperature, softcap=4.0)
    (dh_ref,) = torch.autograd.grad(ref.entropy, h_ref, g_h.cpu())
    assert _max_rel(dh.cpu(), dh_ref) <= 1e-5


@pytest.mark.parametrize("strategy", ["fused", "workspace"])
def test_empty_batch(strategy, monkeypatch):
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    h = torch.zeros(0, 40, device=DEVICE, requires_grad=True)
    w = torch.randn(1021, 40, device=DEVICE, requires_grad=True)
    out = linear_logprobs(h, w, torch.zeros(0, dtype=torch.long, device=DEVICE), backend="triton")
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    dh, dw = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), (h, w))
    assert dh.shape == (0, 40) and bool((dw == 0).all())


@pytest.mark.parametrize(
    "strategy,n,v,chunk_elements,target_programs,dtype",
    [
        ("fused", 3, 4099, None, 4, torch.float32),  # 33 vocab blocks in 4 splits of 9: the last ends in 3 empty
        # 3 forward row chunks of 2, 2, 1; backward 3 token chunks (fp32 dW accumulation, first chunk with beta = 0)
        ("workspace", 5, 1021, 2048, None, torch.float32),
        ("workspace", 5, 1021, 2048, None, torch.bfloat16),
        # backward: vocabulary slices of 128-multiples over all tokens (fp32 dh; dW written per slice)
        ("workspace", 3, 4099, 4500, None, torch.float32),
        ("workspace", 3, 4099, 4500, None, torch.float16),
        # the fused backward's tl.dot gradient kernel on the same blocks (d(raw) from registers)
        ("fused", 5, 1021, 2048, None, torch.bfloat16),
        ("fused", 3, 4099, 4500, None, torch.float32),
        ("fused", 3, 4099, 4500, None, torch.float16),
    ],
    ids=["fused-splits", "workspace-token-chunks", "workspace-token-chunks-bf16", "workspace-vocab-slices",
         "workspace-vocab-slices-fp16", "fused-token-chunks-bf16", "fused-vocab-slices", "fused-vocab-slices-fp16"],
)
def test_grid_and_chunk_plans(strategy, n, v, chunk_elements, target_programs, dtype, monkeypatch):
    from ludic_fast.kernels.head_fwd import launch_config

    from ludic_fast.ops import triton_head
    from ludic_fast.ops.torch_head import HeadTransform

    if target_programs is not None:
        monkeypatch.setattr(triton_head, "_TARGET_PROGRAMS", target_programs)
        assert triton_head.fused_splits(n, v, launch_config(4, 90, n), target_programs) == (4, 9)
    case = Case("x", dtype, n, v, 40, "per-token", softcap=5.0, bias=True, ignore=True)
    hidden, weight, bias, targets, temperature, g_lp, g_h = _inputs(case, seed=7)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    transform = HeadTransform(1.0, 5.0, temperature.double().reciprocal())
    lp, ent, lse = triton_head.triton_linear_logprobs(leaves[0], leaves[1], leaves[2], targets, transform,
                                                      True, -100, strategy=strategy, chunk_elements=chunk_elements)
    grads = torch.autograd.grad((lp, ent), leaves, (g_lp, g_h))
    ref_leaves = [x.float().cpu().requires_grad_() for x in (hidden, weight, bias)]
    ref = reference.linear_logprobs(ref_leaves[0], ref_leaves[1], targets.cpu(), bias=ref_leaves[2], softcap=5.0,
                                    temperature=temperature.cpu())
    ref_grads = torch.autograd.grad((ref.logprobs, ref.entropy), ref_leaves, (g_lp.cpu(), g_h.cpu()))
    torch.testing.assert_close(lp.cpu(), ref.logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.cpu(), ref.entropy, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref.lse, atol=2e-5, rtol=1e-5)
    grad_tol = 1e-5 if dtype == torch.float32 else 1.5e-2  # d(raw) rounded to the GEMM operand dtype
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        assert _max_rel(got.cpu(), want) <= grad_tol


def test_float64_is_rejected_by_the_triton_backend():
    h, w = torch.randn(2, 40, dtype=torch.float64), torch.randn(1021, 40, dtype=torch.float64)
    with pytest.raises(TypeError, match="triton backend"):
        linear_logprobs(h.to(DEVICE), w.to(DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE), backend="triton")


# the TMA variant of the fused strategy's tl.dot kernels (LUDIC_FAST_TMA=1): descriptor loads (zero-filled past
# N, V and D) and the persistent gradient grid, on ragged shapes; and where TMA cannot apply, the pointer loads
TMA_CASES = [  # (case, chunk_elements, descriptors built: h and W per forward and per gradient block)
    # 2 x 8 token x vocab tiles of 128 (N, V, D ragged); 4 programs: 2 vocab splits, 4 gradient tiles each
    (Case("bf16-n130-v1021", torch.bfloat16, 130, 1021, 40, "per-token", softcap=5.0, bias=True, ignore=True),
     None, 4),
    # N <= 64: the 64 x 256 forward tile
    (Case("fp16-n3-v4099", torch.float16, 3, 4099, 72, "0.7", logit_scale=1.3, entropy=False), None, 4),
    # 3 vocabulary slices of 1408 columns (descriptors of W[c0 : c0 + 1408]), fp32 dh accumulation
    (Case("bf16-n3-v4099-slices", torch.bfloat16, 3, 4099, 40, "1", bias=True), 4500, 2 + 2 * 3),
    # fallbacks: rows of 36 bf16 (72 bytes, not 16-byte aligned); non-unit column strides; fp32 (no TMA config)
    (Case("bf16-d36", torch.bfloat16, 40, 1021, 36, "1", bias=True), None, 0),
    (Case("bf16-strided", torch.bfloat16, 3, 1021, 40, "0.7", strided=True), None, 0),
    (Case("fp32", torch.float32, 3, 1021, 40, "1", softcap=5.0), None, 0),
]


@pytest.mark.parametrize("case,chunk_elements,descriptors", TMA_CASES, ids=[c[0].name for c in TMA_CASES])
def test_tma_variant_matches_reference(case, chunk_elements, descriptors, monkeypatch):
    from ludic_fast.kernels import head_fwd

    from ludic_fast.ops import triton_head

    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", "fused")
    monkeypatch.setenv("LUDIC_FAST_TMA", "1")
    monkeypatch.setattr(triton_head, "_TARGET_PROGRAMS", 4)
    blocks = []

    def spy(t, block):
        blocks.append(tuple(block))
        return descriptor(t, block)

    descriptor = head_fwd.descriptor
    monkeypatch.setattr(head_fwd, "descriptor", spy)
    hidden, weight, bias, targets, temperature, g_lp, g_h = _inputs(case, seed=5)

    def triton_fn(*a, **k):
        return linear_logprobs(*a, backend="triton", chunk_elements=chunk_elements, **k)

    out, grads = head_and_grads(triton_fn, case, hidden, weight, bias, targets, temperature, g_lp, g_h)
    assert len(blocks) == (descriptors if SM90 else 0), blocks  # sm_80: pointer loads
    f32 = [None if x is None else x.float().cpu() for x in (hidden, weight, bias)]
    targets, temperature, g_lp, g_h = (_cpu(x) for x in (targets, temperature, g_lp, g_h))
    ref, ref_grads = head_and_grads(reference.linear_logprobs, case, *f32, targets, temperature, g_lp, g_h)
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.lse.cpu(), ref.lse, atol=2e-5, rtol=1e-5)
    if case.entropy:
        torch.testing.assert_close(out.entropy.cpu(), ref.entropy, atol=2e-5, rtol=1e-5)
    grad_tol = 1e-5 if case.dtype == torch.float32 else 1.5e-2
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == case.dtype and _max_rel(got.cpu(), want) <= grad_tol, (name, _max_rel(got.cpu(), want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_held_logits_are_not_recomputed_and_a_second_backward_recomputes_them(dtype, monkeypatch):
    """A workspace plan of one chunk of all N rows keeps the forward's fp32 raw logits for the backward, which
    writes d(raw) over them: its GEMMs are dh and dW only (6NDV in all). A second backward (retain_graph) finds
    them overwritten and recomputes them. Both backwards equal the reference."""
    from ludic_fast.ops import triton_head
    from ludic_fast.ops.plan import plan_head

    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", "workspace")
    n, v, d = 5, 1021, 40
    assert plan_head(n, d, v, dtype=dtype, device=DEVICE, strategy="workspace").hold_logits
    case = Case("x", dtype, n, v, d, "per-token", softcap=5.0, bias=True, ignore=True)
    hidden, weight, bias, targets, temperature, g_lp, g_h = _inputs(case, seed=11)
    gemms = []
    gemm_into = triton_head.gemm_into

    def counted(out, a, b, *, accumulate):
        gemms.append(tuple(out.shape))
        gemm_into(out, a, b, accumulate=accumulate)

    monkeypatch.setattr(triton_head, "gemm_into", counted)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    out = linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], temperature=temperature, softcap=5.0,
                          backend="triton")
    assert gemms == [(n, v)]
    first = torch.autograd.grad((out.logprobs, out.entropy), leaves, (g_lp, g_h), retain_graph=True)
    assert gemms[1:] == [(n, d), (v, d)]  # dh and dW from the held logits
    second = torch.autograd.grad((out.logprobs, out.entropy), leaves, (g_lp, g_h))
    assert gemms[3:] == [(n, v), (n, d), (v, d)]  # the logits again, then dh and dW
    ref_leaves = [x.float().cpu().requires_grad_() for x in (hidden, weight, bias)]
    ref = reference.linear_logprobs(ref_leaves[0], ref_leaves[1], targets.cpu(), bias=ref_leaves[2], softcap=5.0,
                                    temperature=temperature.cpu())
    ref_grads = torch.autograd.grad((ref.logprobs, ref.entropy), ref_leaves, (g_lp.cpu(), g_h.cpu()))
    grad_tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for name, a, b, want in zip(("hidden", "weight", "bias"), first, second, ref_grads):
        assert _max_rel(a.cpu(), want) <= grad_tol and _max_rel(b.cpu(), want) <= grad_tol, name
        assert _max_rel(b.cpu(), a.cpu()) <= (1e-6 if dtype == torch.float32 else 8e-3), name
