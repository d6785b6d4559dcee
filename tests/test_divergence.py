"""linear_divergence against its reference twin (fp32 loss and student grads 1e-5; kinds, reductions, hard-label
mixing, ignore_index, temperature, different hidden sizes and dtypes, several chunks), no N*V allocation,
FLOPs, the teacher gets no gradient, and Liger's / TRL's chunked divergences on the same inputs."""

from __future__ import annotations

import pytest
import torch
from _alloc import LargestAllocation
from test_losses_common import rel_err
from torch.utils.flop_counter import FlopCounterMode

from ludic_fast import linear_divergence
from ludic_fast import reference as R

N, DS, DT, V = 23, 12, 20, 101
ROW = 16 * V  # memory budget of one row: 23 rows -> 23 chunks; 7 rows a chunk below
BUDGET = 7 * ROW


def _inputs(seed=0, dtype=torch.float32, teacher_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(N, DS, generator=g)).to(dtype).requires_grad_(True)
    Ws = (torch.randn(V, DS, generator=g) * 0.4).to(dtype).requires_grad_(True)
    bs = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_(True)
    ht = torch.randn(N, DT, generator=g).to(teacher_dtype)
    Wt = (torch.randn(V, DT, generator=g) * 0.4).to(teacher_dtype).requires_grad_(True)
    bt = (torch.randn(V, generator=g) * 0.3).to(teacher_dtype)
    tgt = torch.randint(0, V, (N,), generator=g)
    tgt[[2, 5, 11]] = -100
    return hs, Ws, bs, ht, Wt, bt, tgt


OPTIONS = [
    dict(kind="forward_kl"),
    dict(kind="reverse_kl"),
    dict(kind="jsd", beta=0.5),
    dict(kind="jsd", beta=0.1, temperature=2.0),
    dict(kind="forward_kl", temperature=0.7, hard_weight=0.3),
    dict(kind="reverse_kl", hard_weight=0.5),
    dict(kind="jsd", beta=0.7, temperature=1.5, hard_weight=0.2),
]


CASES = [(o, t) for o in OPTIONS for t in (True, False) if t or not o.get("hard_weight")]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts,with_targets", CASES,
                         ids=["-".join(f"{k}={v}" for k, v in o.items()) + ("-targets" * t) for o, t in CASES])
def test_matches_reference(opts, reduction, with_targets):
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs()
    tgt = tgt if with_targets else None
    kw = dict(opts, reduction=reduction, b_student=bs, b_teacher=bt)
    ref = R.linear_divergence(hs, Ws, ht, Wt, tgt, **kw)
    out = linear_divergence(hs, Ws, ht, Wt, tgt, memory_budget=BUDGET, **kw)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)) if reduction == "none" else None
    assert rel_err(out, ref) <= 1e-5
    g_ref = torch.autograd.grad(ref, (hs, Ws, bs), up)
    g_out = torch.autograd.grad(out, (hs, Ws, bs), up)
    for n, a, b in zip(("hidden", "weight", "bias"), g_out, g_ref):
        assert rel_err(a, b) <= 1e-5, (n, rel_err(a, b))


def test_mixed_dtypes_and_bf16_teacher():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(teacher_dtype=torch.bfloat16)
    ref = R.linear_divergence(hs, Ws, ht, Wt, tgt, kind="jsd", b_student=bs, b_teacher=bt)
    out = linear_divergence(hs, Ws, ht, Wt, tgt, kind="jsd", b_student=bs, b_teacher=bt, memory_budget=BUDGET)
    assert rel_err(out, ref) <= 1e-5
    for a, b in zip(torch.autograd.grad(out, (hs, Ws)), torch.autograd.grad(ref, (hs, Ws))):
        assert rel_err(a, b) <= 1e-5


def test_teacher_gets_no_gradient_and_gradcheck_float64():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(dtype=torch.float64, teacher_dtype=torch.float64)
    out = linear_divergence(hs, Ws, ht, Wt, tgt, kind="reverse_kl", b_student=bs, memory_budget=BUDGET)
    assert out.dtype == torch.float64
    out.backward()
    assert Wt.grad is None and hs.grad is not None

    # on the first 8 rows (two ignored) and 29 tokens: 3 chunks of 3, 3, 2 rows (four float64 buffers a logit)
    n, v = 8, 29
    sub_tgt = torch.where(tgt[:n] >= 0, tgt[:n] % v, tgt[:n])

    def f(h, w):
        return linear_divergence(h, w, ht[:n], Wt[:v], sub_tgt, kind="jsd", beta=0.3, hard_weight=0.4,
                                 temperature=1.3, memory_budget=3 * 4 * 8 * v, reduction="none")

    assert (sub_tgt == -100).sum() == 2
    assert torch.autograd.gradcheck(f, (hs[:n].detach().requires_grad_(), Ws[:v].detach().requires_grad_()))


def test_no_tokens_by_vocab_tensor_and_flops():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs()
    for reduction, student_gemms in (("mean", 3), ("none", 4)):
        with LargestAllocation() as probe, FlopCounterMode(display=False) as fc:
            out = linear_divergence(hs, Ws, ht, Wt, tgt, kind="jsd", b_student=bs, memory_budget=BUDGET,
                                    reduction=reduction)
            out.sum().backward()
        assert probe.largest < N * V, (probe.op, probe.largest)
        passes = 1 if reduction == "mean" else 2  # 'none' recomputes both heads in the backward
        assert fc.get_total_flops() == 2 * N * V * (student_gemms * DS + passes * DT)  # the GEMMs, nothing else


def test_validation():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs()
    with pytest.raises(ValueError, match="kind"):
        linear_divergence(hs, Ws, ht, Wt, kind="tvd")
    with pytest.raises(ValueError, match="beta"):
        linear_divergence(hs, Ws, ht, Wt, kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match="W_teacher"):
        linear_divergence(hs, Ws, ht, Wt[:-1])
    with pytest.raises(ValueError, match="leading"):
        linear_divergence(hs, Ws, ht[:-1], Wt)
    with pytest.raises(ValueError, match="hard_weight"):
        linear_divergence(hs, Ws, ht, Wt, hard_weight=0.5)
    with pytest.raises(ValueError, match="targets"):
        linear_divergence(hs, Ws, ht, Wt, torch.full((N,), V))
    with pytest.raises(ValueError, match="temperature"):
        linear_divergence(hs, Ws, ht, Wt, temperature=0.0)
    with pytest.raises(ValueError, match="memory_budget"):
        linear_divergence(hs, Ws, ht, Wt, memory_budget=0)
    with pytest.raises(TypeError, match="h_student"):
        linear_divergence(tgt, Ws, ht, Wt)


# ------------------------------------------------------------------------------------------------ peers
@pytest.mark.parametrize("beta,kind", [(0.0, "forward_kl"), (1.0, "reverse_kl"), (0.3, "jsd")])
def test_matches_liger_chunked_jsd(beta, kind):
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    hs, Ws, _, ht, Wt, _, tgt = _inputs(2)
    for hard, temp in ((0.0, 1.7), (0.4, 1.0)):
        peer_fn = chunked.LigerFusedLinearJSDLoss(weight_hard_loss=hard, weight_soft_loss=1.0 - hard, beta=beta,
                                                  temperature=temp, compiled=False, chunk_size=8)
        peer = peer_fn(hs, Ws, ht, Wt, tgt)
        ours = linear_divergence(hs, Ws, ht, Wt, tgt, kind=kind, beta=0.5 if kind != "jsd" else beta,
                                 temperature=temp, hard_weight=hard, memory_budget=BUDGET)
        assert rel_err(ours, peer) <= 1e-5, (float(ours), float(peer))
        for a, b in zip(torch.autograd.grad(ours, (hs, Ws)), torch.autograd.grad(peer, (hs, Ws))):
            assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("beta,kind", [(0.0, "forward_kl"), (1.0, "reverse_kl"), (0.6, "jsd")])
def test_matches_trl_chunked_divergence(beta, kind):
    trl_div = pytest.importorskip("trl.kernels.chunked_divergence")
    hs, Ws, bs, ht, Wt, bt, _ = _inputs(3)
    peer, _ = trl_div.ChunkedDivergenceFunction.apply(hs, Ws, bs, ht, Wt.detach(), bt, beta, 1.4)
    ours = linear_divergence(hs, Ws, ht, Wt, kind=kind, beta=0.5 if kind != "jsd" else beta, temperature=1.4,
                             b_student=bs, b_teacher=bt, reduction="none", memory_budget=BUDGET)
    assert rel_err(ours, peer) <= 1e-5
    up = torch.rand(N, generator=torch.Generator().manual_seed(4))
    for a, b in zip(torch.autograd.grad(ours, (hs, Ws, bs), up), torch.autograd.grad(peer, (hs, Ws, bs), up)):
        assert rel_err(a, b) <= 1e-4


def test_bf16_student_loose():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(5)
    hb, Wb = hs.detach().bfloat16().requires_grad_(True), Ws.detach().bfloat16().requires_grad_(True)
    ref = R.linear_divergence(hb.float(), Wb.float(), ht, Wt, tgt, kind="jsd", hard_weight=0.2)
    out = linear_divergence(hb, Wb, ht, Wt, tgt, kind="jsd", hard_weight=0.2, memory_budget=BUDGET)
    assert rel_err(out, ref) <= 1e-4
    g, rg = torch.autograd.grad(out, (hb,))[0], torch.autograd.grad(ref, (hb,))[0]
    assert g.dtype == torch.bfloat16 and rel_err(g.float(), rg.float()) <= 2e-2
