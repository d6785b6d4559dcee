"""The distillation row kernel (backend='triton') equals the torch path of linear_divergence and the float64
reference twin (under TRITON_INTERPRET=1 on CPU, or on CUDA): loss and student gradients, every kind, with
temperature (scalar and per token), softcap, logit scale, biases, hard-label mixing (target id 0 included),
ignored rows, per-token reduction, several chunks, a vocabulary not a multiple of the block with the row
maximum in its tail block, masked (-inf) columns, teachers given as probabilities or top-k log-probs; and
the clear refusal of what the kernel lacks."""

from __future__ import annotations

import pytest
import torch
from _interp import DEVICE, MARKS
from _jsd_far_teacher import jsd_errors_far_teacher

from ludic_fast import linear_divergence
from ludic_fast import reference as R

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


# ------------------------------------------------------------------------------------------------ options
def _reference_check(out, ref, leaves, up=None, tol=1e-5):
    """The kernel's loss and student gradients against the float64 reference twin."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=1e-7)
    for a, b in zip(torch.autograd.grad(out, leaves, up), torch.autograd.grad(ref, leaves, up)):
        torch.testing.assert_close(a.double(), b, rtol=10 * tol, atol=1e-6)


def _double(*xs):
    return [x.detach().double().requires_grad_(x.requires_grad) for x in xs]


OPTIONS = [
    dict(kind="forward_kl", softcap=2.0, logit_scale=1.5),
    dict(kind="reverse_kl", temperature="per-token", hard_weight=0.3),
    dict(kind="jsd", beta=0.4, softcap=3.0, temperature="per-token", hard_weight=0.2),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_softcap_scale_per_token_temperature(opts):
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(2)
    if opts.get("temperature") == "per-token":
        opts = dict(opts, temperature=torch.linspace(0.6, 1.8, N).to(DEVICE))
    out = linear_divergence(hs, Ws, ht, Wt, tgt, backend="triton", b_student=bs, b_teacher=bt,
                            memory_budget=20 * V * 3, **opts)
    d = _double(hs, Ws, bs)
    ref = R.linear_divergence(d[0], d[1], ht.double(), Wt.double(), tgt, b_student=d[2], b_teacher=bt.double(),
                              **opts)
    grads = torch.autograd.grad(out, (hs, Ws, bs))
    for a, b in zip(grads, torch.autograd.grad(ref, d)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_probability_and_topk_teachers(kind):
    """Teachers given as probabilities (one zero column) and as top-k log-probs, temperature 1.3, against the
    float64 twin. (On CUDA at 6e98f8f both kinds failed inside the twin, whose top-k row was built on the CPU:
    tests/test_divergence_features.py now runs the twin on the meta device for every teacher form.)"""
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(3)
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(N, V, generator=g) * 2, -1).to(DEVICE)
    probs[:, 2050] = 0.0
    lp, idx = torch.log_softmax(torch.randn(N, V, generator=g) * 3, -1).topk(40, -1)
    d = _double(hs, Ws)
    for teacher in (dict(teacher_probs=probs), dict(teacher_topk=(idx.to(DEVICE), lp.to(DEVICE)))):
        out = linear_divergence(hs, Ws, targets=tgt, kind=kind, temperature=1.3, backend="triton", **teacher)
        ref_teacher = {k: (v.double() if k == "teacher_probs" else (v[0], v[1].double())) for k, v in teacher.items()}
        ref = R.linear_divergence(d[0], d[1], targets=tgt, kind=kind, temperature=1.3, **ref_teacher)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-7)
        for a, b in zip(torch.autograd.grad(out, (hs, Ws)), torch.autograd.grad(ref, d)):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)


def test_jsd_gradient_against_a_far_top_k_teacher():
    """V = 8195 (four blocks and a tail), a top-k teacher on the student's 4 least likely tokens
    (`_jsd_far_teacher`): the gradient is a small difference of its terms. Within 1e-5 of the float64 twin
    (the kernel whose JSD sums were fp32 and whose ā was not divided by Σ p: 3.1e-4 on d(hidden))."""
    loss_err, dh_err, dw_err = jsd_errors_far_teacher(8195, 4, "triton", DEVICE)
    assert loss_err <= 1e-6 and dh_err <= 1e-5 and dw_err <= 1e-5, (loss_err, dh_err, dw_err)


def test_row_maximum_in_the_tail_block_and_target_zero():
    """The row maximum sits in the last (partial) block, so the online sums are rescaled when the maximum
    moves; one target is token 0 (a hard-label CE that must count)."""
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(5)
    with torch.no_grad():
        bs[2050] += 9.0
        bt[2051] += 9.0
    tgt[0] = 0
    tgt[4] = 2050
    d = _double(hs, Ws, bs)
    for opts in (dict(kind="forward_kl"), dict(kind="reverse_kl"), dict(kind="jsd", beta=0.3),
                 dict(kind="reverse_kl", hard_weight=0.6), dict(kind="forward_kl", hard_weight=0.6, temperature=0.7)):
        out = linear_divergence(hs, Ws, ht, Wt, tgt, backend="triton", b_student=bs, b_teacher=bt,
                                reduction="none", **opts)
        ref = R.linear_divergence(d[0], d[1], ht.double(), Wt.double(), tgt, b_student=d[2], b_teacher=bt.double(),
                                  reduction="none", **opts)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-7, msg=str(opts))
        up = torch.rand(N, generator=torch.Generator().manual_seed(6)).to(DEVICE)
        for a, b in zip(torch.autograd.grad(out, (hs, Ws, bs), up), torch.autograd.grad(ref, d, up.double())):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6, msg=str(opts))


MASK = [0, 1, 700, 2048, 2052]  # the first columns of two blocks, one inside, the last


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_masked_vocabulary(kind):
    """-inf on the same columns of both heads: finite, equal to the reference; -inf on the teacher's only:
    forward KL and JSD finite and equal, reverse KL +inf."""
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(7)
    mask = torch.zeros(V).index_fill(0, torch.tensor(MASK), float("-inf")).to(DEVICE)
    d = _double(hs, Ws, bs)
    for b_s, teacher_only in ((bs + mask, False), (bs, True)):
        out = linear_divergence(hs, Ws, ht, Wt, tgt, kind=kind, backend="triton", b_student=b_s,
                                b_teacher=bt + mask, reduction="none", hard_weight=0.25)
        ref = R.linear_divergence(d[0], d[1], ht.double(), Wt.double(), tgt, kind=kind, reduction="none",
                                  b_student=d[2] if teacher_only else d[2] + mask.double(),
                                  b_teacher=(bt + mask).double(), hard_weight=0.25)
        if teacher_only and kind == "reverse_kl":
            assert torch.isinf(out[tgt != -100]).all() and (out[tgt == -100] == 0).all()
            continue
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-7)
        up = torch.rand(N, generator=torch.Generator().manual_seed(8)).to(DEVICE)
        for a, b in zip(torch.autograd.grad(out, (hs, Ws), up), torch.autograd.grad(ref, d[:2], up.double())):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)


def test_identical_heads_give_zero_not_negative():
    """Same head for both at T = 0.01 (logits in the hundreds): D = 0 up to rounding relative to the row
    maxima, never below."""
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(9)
    h = hs.detach() * 4
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        out = linear_divergence(h, Ws.detach(), h, Ws.detach(), kind=kind, beta=0.37, backend="triton",
                                reduction="none", temperature=0.01)
        assert (out >= 0).all() and out.max() <= 1e-7, (kind, out.max())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_token_vocabulary_gives_exact_zeros(backend):
    """V = 1: every distribution is the point mass, so D, CE and every gradient are exactly 0 (here at
    T = 1e-3 with a softcap, where logits are large)."""
    g = torch.Generator().manual_seed(10)
    hs = torch.randn(5, 3, generator=g).to(DEVICE).requires_grad_(True)
    Ws = torch.randn(1, 3, generator=g).to(DEVICE).requires_grad_(True)
    ht, Wt = torch.randn(5, 4, generator=g).to(DEVICE), torch.randn(1, 4, generator=g).to(DEVICE)
    tgt = torch.zeros(5, dtype=torch.long, device=DEVICE)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        out = linear_divergence(hs, Ws, ht, Wt, tgt, kind=kind, hard_weight=0.3, temperature=1e-3, softcap=0.5,
                                backend=backend)
        assert float(out) == 0.0
        assert all((x == 0).all() for x in torch.autograd.grad(out, (hs, Ws)))


def test_triton_refuses_what_the_kernel_lacks():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs()
    topk = (torch.arange(3).expand(N, 3).to(DEVICE), torch.full((N, 3), -2.0).to(DEVICE))
    with pytest.raises(ValueError, match="bucket"):
        linear_divergence(hs, Ws, teacher_topk=topk, teacher_tail="bucket", backend="triton")


def test_entropy_matches_reference():
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(11)
    kw = dict(kind="jsd", softcap=2.5, temperature=torch.linspace(0.6, 1.6, N).to(DEVICE), hard_weight=0.2)
    out, ent = linear_divergence(hs, Ws, ht, Wt, tgt, backend="triton", b_student=bs, return_entropy=True, **kw)
    plain = linear_divergence(hs, Ws, ht, Wt, tgt, backend="triton", b_student=bs, **kw)
    _, want = R.linear_divergence(hs.double(), Ws.double(), ht.double(), Wt.double(), tgt, b_student=bs.double(),
                                  return_entropy=True, **kw)
    assert ent.dtype == torch.float32 and not ent.requires_grad and (ent[tgt == -100] == 0).all()
    torch.testing.assert_close(ent.double(), want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("offset", [0.0, 100.0, 1e3])
def test_entropy_of_confident_tokens_is_accurate(offset):
    """Peaked rows (one logit leading by 2 to 28, in either vocabulary block) plus a common bias: fp32 entropy
    within 1e-3 relative where H >= 1e-5 and 1e-7 absolute below, never negative, against the float64 entropy
    of the very fp32 logits the op forms (hidden = logits, W = identity)."""
    g = torch.Generator().manual_seed(12)
    n, v = 48, V
    lead = torch.linspace(2.0, 28.0, n, dtype=torch.float64)[:, None]
    where = torch.randint(0, v, (n, 1), generator=g)
    where[::3] = 2048 + torch.arange(0, n, 3)[:, None] % 5  # the maximum in the tail block
    z = torch.randn(n, v, generator=g, dtype=torch.float64).scatter_add(1, where, lead)
    h32, b32, eye = z.float().to(DEVICE), torch.full((v,), offset, device=DEVICE), torch.eye(v, device=DEVICE)
    uniform = torch.full((n, v), 1.0 / v, device=DEVICE)
    _, want = R.linear_divergence((h32 + b32).double().cpu(), eye.double().cpu(),
                                  teacher_probs=uniform.double().cpu(), return_entropy=True)
    _, got = linear_divergence(h32, eye, b_student=b32, teacher_probs=uniform, return_entropy=True,
                               backend="triton")
    got = got.double().cpu()
    assert (got >= 0).all()
    big = want >= 1e-5
    assert big.sum() >= 10 and (~big).sum() >= 10
    err = (got - want).abs()
    assert (err / want)[big].max() <= 1e-3, (err / want)[big].max()
    assert err[~big].max() <= 1e-7, err[~big].max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_bad_per_token_temperature_gives_nan_not_a_number(backend, kind):
    """A per-token temperature entry that is NaN, 0, negative or inf makes that token's loss and entropy NaN
    (no silent value); the other tokens are untouched."""
    hs, Ws, bs, ht, Wt, bt, tgt = _inputs(13)
    temp = torch.ones(N)
    bad = torch.tensor([1, 3, 4, 6])
    temp[bad] = torch.tensor([float("nan"), 0.0, -1.0, float("inf")])
    kw = dict(kind=kind, reduction="none", backend=backend, return_entropy=True)
    out, ent = linear_divergence(hs, Ws, ht, Wt, temperature=temp.to(DEVICE), **kw)
    ref, ref_h = linear_divergence(hs, Ws, ht, Wt, **kw)
    good = torch.ones(N, dtype=torch.bool)
    good[bad] = False
    assert out.cpu()[~good].isnan().all() and ent.cpu()[~good].isnan().all()
    torch.testing.assert_close(out[good.to(DEVICE)], ref[good.to(DEVICE)], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(ent[good.to(DEVICE)], ref_h[good.to(DEVICE)], rtol=1e-6, atol=0.0)
    # the same tokens ignored: they count for nothing, gradients included (finite, as with temperature 1 there)
    tgt = torch.where(good, 0, -100).to(DEVICE)
    kw = dict(kind=kind, backend=backend, return_entropy=True)
    out, ent = linear_divergence(hs, Ws, ht, Wt, tgt, temperature=temp.to(DEVICE), **kw)
    ref, _ = linear_divergence(hs, Ws, ht, Wt, tgt, **kw)
    assert (ent.cpu()[~good] == 0).all()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0.0)
    for a, b in zip(torch.autograd.grad(out, (hs, Ws)), torch.autograd.grad(ref, (hs, Ws))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_reverse_kl_row_of_infinite_divergence_has_nan_gradients_as_torch():
    """A teacher with no mass on some columns of one row, where the student has mass: that row's reverse KL is
    +inf and has no gradient, so dW and db are NaN on the kernel as on the torch backend (not ±inf)."""
    hs, Ws, bs, _, _, _, tgt = _inputs(13)
    probs = torch.softmax(torch.randn(N, V, generator=torch.Generator().manual_seed(14)), -1)
    probs[2, 5:40] = 0.0
    probs = (probs / probs.sum(-1, keepdim=True)).to(DEVICE)
    got = {}
    for backend in ("torch", "triton"):
        out = linear_divergence(hs, Ws, teacher_probs=probs, kind="reverse_kl", backend=backend, b_student=bs,
                                reduction="none")
        assert bool(torch.isinf(out[2])) and bool(torch.isfinite(out[[0, 1, 4, 5, 6]]).all()), backend
        got[backend] = torch.autograd.grad(out.sum(), (hs, Ws, bs))
    for name, a, b in zip(("hidden", "weight", "bias"), got["triton"], got["torch"]):
        assert bool(torch.isnan(b).any()), name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, equal_nan=True, msg=name)
