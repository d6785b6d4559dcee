"""The triton backend under `torch.compile`: the head op, a fused loss (CISPO, fused and generic modes) and the
distillation divergence run outside the graph (one graph break each) and give the eager numbers and gradients.
(Traced, the interpreter's launch path fails in dynamo's fake-tensor pass.)"""

from __future__ import annotations

import pytest
import torch
from _interp import DEVICE, MARKS
from test_losses_common import make_batch

from ludic_fast import linear_divergence
from ludic_fast.losses import CISPOLoss
from ludic_fast.ops import linear_logprobs

pytestmark = MARKS


def _head(h, w, b, batch):
    targets = batch["input_ids"][:, 1:].reshape(-1)
    out = linear_logprobs(h[:, :-1].reshape(-1, h.shape[-1]), w, targets, bias=b, backend="triton")
    return out.logprobs.sum() + 0.5 * out.entropy.sum()


def _cispo(fused):
    def loss(h, w, b, batch):
        return CISPOLoss(clip_eps_high=0.2)(batch, hidden=h, weight=w, bias=b, backend="triton", fused=fused)[0]

    return loss


def _divergence(h, w, b, batch):
    teacher = torch.Generator().manual_seed(3)
    h_t = torch.randn(*h.shape[:-1], 8, generator=teacher).to(DEVICE)
    w_t = torch.randn(w.shape[0], 8, generator=teacher).to(DEVICE)
    return linear_divergence(h, w, h_t, w_t, kind="jsd", b_student=b, backend="triton")


@pytest.mark.parametrize("fn", [_head, _cispo(True), _cispo(False), _divergence],
                         ids=["head", "cispo-fused", "cispo-generic", "jsd"])
def test_compiled_equals_eager(fn):
    batch, h, w, b = make_batch(0)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    leaves = [x.detach().to(DEVICE).requires_grad_(True) for x in (h, w, b)]
    want = fn(*leaves, batch)
    want_grads = torch.autograd.grad(want, leaves)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager")(*leaves, batch)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)
