"""`_patch_once` (triton.language patched once per interpreter launch) changes nothing the kernels compute: the
head op on both strategies (forward, merge, gradient and row kernels) and the divergence row kernel give the
same bits with it and with the interpreter's patch at every helper call; and the probe that decides whether the
suite runs at all (`_interp.PROBLEM`, which turns any error into a skip of every kernel test) gives the same
verdict."""

from __future__ import annotations

import pytest
import torch
from _interp import INTERPRET, PROBLEM, interpreter_problem
from _patch_once import patching_every_call

from ludic_fast import linear_divergence
from ludic_fast.ops import linear_logprobs

pytestmark = [pytest.mark.interpret, pytest.mark.skipif(not INTERPRET, reason="the interpreter's: TRITON_INTERPRET=1")]


def test_the_probe_gives_the_same_verdict():
    with patching_every_call():
        assert interpreter_problem() == PROBLEM


def _head_and_divergence(monkeypatch) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 40, generator=g).requires_grad_(True)
    w = (torch.randn(300, 40, generator=g) * 0.3).requires_grad_(True)
    b = torch.randn(300, generator=g).requires_grad_(True)
    targets = torch.tensor([0, 17, -100, 299, 128])
    out = []
    for strategy in ("fused", "workspace"):
        monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
        res = linear_logprobs(h, w, targets, bias=b, softcap=4.0, temperature=0.7, backend="triton")
        out += [res.logprobs, res.entropy, *torch.autograd.grad((res.logprobs + res.entropy).sum(), (h, w, b))]
    teacher_h, teacher_w = torch.randn(5, 24, generator=g), torch.randn(300, 24, generator=g)
    loss, ent = linear_divergence(h, w, teacher_h, teacher_w, targets, kind="jsd", beta=0.3, hard_weight=0.2,
                                  b_student=b, return_entropy=True, backend="triton")
    return [*out, loss, ent, *torch.autograd.grad(loss, (h, w, b))]


@pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))
def test_kernels_give_the_same_bits_as_with_a_patch_at_every_call(monkeypatch):
    once = _head_and_divergence(monkeypatch)
    with patching_every_call():
        every = _head_and_divergence(monkeypatch)
    assert len(once) == len(every) == 15
    for i, (a, b) in enumerate(zip(once, every)):
        assert torch.equal(a, b), i
