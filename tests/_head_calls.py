"""Scalar head calls on a Ludic batch (`test_losses_common.make_batch`), shared by the autocast tests (unit and
interpreter suites) and the torch.compile test: each `fn(h, w, b, batch, cast=None)` is differentiable w.r.t.
hidden h [B, T, D], weight w [V, D] and bias b [V]; `cast` is the dtype of any further operand the call draws
itself (the JSD teacher), None to keep fp32."""

from __future__ import annotations

import torch
from test_losses_common import make_batch

from ludic_fast import linear_divergence
from ludic_fast.losses import CISPOLoss
from ludic_fast.ops import linear_logprobs


def head_op(backend):
    """logprobs.sum() + entropy.sum() / 2 of the head op on the shifted positions."""

    def run(h, w, b, batch, cast=None):
        targets = batch["input_ids"][:, 1:].reshape(-1)
        out = linear_logprobs(h[:, :-1].reshape(-1, h.shape[-1]), w, targets, bias=b, backend=backend)
        return out.logprobs.sum() + 0.5 * out.entropy.sum()

    return run


def cispo(backend, fused):
    """The CISPO loss, fused-loss mode or generic (fused=False)."""

    def run(h, w, b, batch, cast=None):
        return CISPOLoss(clip_eps_high=0.2)(batch, hidden=h, weight=w, bias=b, backend=backend, fused=fused)[0]

    return run


def jsd(backend):
    """JSD against a fixed random teacher (D_t = 8)."""

    def run(h, w, b, batch, cast=None):
        g = torch.Generator().manual_seed(3)
        h_t = torch.randn(*h.shape[:-1], 8, generator=g).to(h.device, cast)
        w_t = torch.randn(w.shape[0], 8, generator=g).to(h.device, cast)
        return linear_divergence(h, w, h_t, w_t, kind="jsd", b_student=b, backend=backend)

    return run


def calls(backend) -> dict:
    """Every call above on `backend`, by test id."""
    return {"head": head_op(backend), "cispo-fused": cispo(backend, True), "cispo-generic": cispo(backend, False),
            "jsd": jsd(backend)}


def batch_and_leaves(device: str) -> tuple[dict, list[torch.Tensor]]:
    """make_batch(0) on `device` and fresh fp32 leaves (hidden, weight, bias) there."""
    batch, h, w, b = make_batch(0)
    batch = {k: v.to(device) for k, v in batch.items()}
    return batch, [x.detach().to(device).requires_grad_(True) for x in (h, w, b)]
