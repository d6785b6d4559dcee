"""Inside `torch.autocast` the head casts its fp32 operands (hidden, weight, bias) to the autocast dtype, as
autocast casts a matmul's inputs, and computes with autocast off: the head op, the RL losses (fused and generic
modes) and the distillation divergence give, inside autocast with fp32 leaves, exactly what they give outside it
with those leaves cast to the autocast dtype (values and the gradients that reach the fp32 leaves). fp64
operands, which autocast leaves alone, are not cast. The triton backend's twin is in tests/interpret."""

from __future__ import annotations

import pytest
import torch
from _head_calls import batch_and_leaves, calls, head_op
from test_losses_common import make_batch


def check_autocast_equals_cast_operands(fn, device: str, dtype=torch.bfloat16) -> None:
    batch, leaves = batch_and_leaves(device)
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


CASES = calls("torch")


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
