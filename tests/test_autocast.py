"""Inside `torch.autocast` the head casts its fp32 operands (hidden, weight, bias) to the autocast dtype, as
autocast casts a matmul's inputs, and computes with autocast off: the head op, the RL losses (fused and generic
modes) and the distillation divergence give, inside autocast with fp32 leaves, exactly what they give outside it
with those leaves cast to the autocast dtype (values and the gradients that reach the fp32 leaves). fp64
operands, which autocast leaves alone, are not cast. The triton backend's twin is in tests/interpret."""

from __future__ import annotations

import pytest
import torch
from test_losses_common import make_batch

from ludic_fast import linear_divergence
from ludic_fast.losses import CISPOLoss
from ludic_fast.ops import linear_logprobs


def head_op(backend):
    def run(h, w, b, batch, cast=None):
        targets = batch["input_ids"][:, 1:].reshape(-1)
        out = linear_logprobs(h[:, :-1].reshape(-1, h.shape[-1]), w, targets, bias=b, backend=backend)
        return out.logprobs.sum() + 0.5 * out.entropy.sum()

    return run


def cispo(backend, fused):
    def run(h, w, b, batch, cast=None):
        return CISPOLoss(clip_eps_high=0.2)(batch, hidden=h, weight=w, bias=b, backend=backend, fused=fused)[0]

    return run


def jsd(backend):
    def run(h, w, b, batch, cast=None):
        """`cast`: the teacher's operands in that dtype (autocast casts them too)."""
        g = torch.Generator().manual_seed(3)
        h_t = torch.randn(*h.shape[:-1], 8, generator=g).to(h.device, cast)
        w_t = torch.randn(w.shape[0], 8, generator=g).to(h.device, cast)
        return linear_divergence(h, w, h_t, w_t, kind="jsd", b_student=b, backend=backend)

    return run


def check_autocast_equals_cast_operands(fn, device: str, dtype=torch.bfloat16) -> None:
    batch, h, w, b = make_batch(0)
    batch = {k: v.to(device) for k, v in batch.items()}
    leaves = [x.detach().to(device).requires_grad_(True) for x in (h, w, b)]
    with torch.autocast(device, dtype=dtype):
        got = fn(*leaves, batch)
    got_grads = torch.autograd.grad(got, leaves)
    want = fn(*(x.to(dtype) for x in leaves), batch, cast=dtype)  # the same leaves, cast differentiably
    want_grads = torch.autograd.grad(want, leaves)
    assert got.dtype == want.dtype and torch.equal(got, want), (float(got), float(want))
    for g, w_ in zip(got_grads, want_grads):
        assert g.dtype == torch.float32 and torch.equal(g, w_)
    full = fn(*leaves, batch)  # and it is not the fp32 computation (the cast really happened)
    assert not torch.equal(full, got)


CASES = {"head": head_op("torch"), "cispo-fused": cispo("torch", True), "cispo-generic": cispo("torch", False),
         "jsd": jsd("torch")}


CUDA = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: none on this machine"))
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=CUDA, id="cuda")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_casts_the_operands(name, device):
    check_autocast_equals_cast_operands(CASES[name], device)


def test_fp64_operands_are_not_cast():
    batch, h, w, b = make_batch(0, dtype=torch.float64)
    fn = head_op("torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(h, w, b, batch)
    assert torch.equal(got, fn(h, w, b, batch))
