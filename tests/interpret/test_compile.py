"""The triton backend under `torch.compile`: the head op, a fused loss (CISPO, fused and generic modes) and the
distillation divergence run outside the graph (one graph break each) and give the eager numbers and gradients.
(Traced, the interpreter's launch path fails in dynamo's fake-tensor pass.)"""

from __future__ import annotations

import pytest
import torch
from _head_calls import batch_and_leaves, calls
from _interp import DEVICE, MARKS

pytestmark = MARKS
CASES = calls("triton")


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_equals_eager(name):
    fn = CASES[name]
    batch, leaves = batch_and_leaves(DEVICE)
    want = fn(*leaves, batch)
    want_grads = torch.autograd.grad(want, leaves)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager")(*leaves, batch)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)
