"""Every setting is checked where it enters: a one-line ValueError / TypeError naming the argument for NaN,
infinite or contradictory values (the head op, the fused losses, the reference, the loss constructors)."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses_common import make_batch

from ludic_fast import losses as L
from ludic_fast import reference as R
from ludic_fast.ops import linear_logprobs

NAN, INF = math.nan, math.inf


def _head():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(11, 8, generator=g), torch.randint(0, 11, (4,), generator=g)


def _raises(exc, name, fn):
    with pytest.raises(exc, match=name) as info:
        fn()
    assert "\n" not in str(info.value), str(info.value)


BAD_HEAD_SETTINGS = [
    ("temperature", {"temperature": NAN}),
    ("temperature", {"temperature": INF}),
    ("temperature", {"temperature": 0.0}),
    ("temperature", {"temperature": torch.tensor([1.0, NAN, 1.0, 1.0])}),
    ("temperature", {"temperature": torch.tensor([1.0, INF, 1.0, 1.0])}),
    ("temperature", {"temperature": torch.tensor(-1.0)}),
    ("temperature", {"temperature": torch.full((4,), 0.7, requires_grad=True)}),
    ("softcap", {"softcap": NAN}),
    ("softcap", {"softcap": INF}),
    ("softcap", {"softcap": 0.0}),
    ("logit_scale", {"logit_scale": NAN}),
    ("logit_scale", {"logit_scale": INF}),
]
FLOAT_SETTINGS = [case for case in BAD_HEAD_SETTINGS if not isinstance(case[1].get("temperature"), torch.Tensor)]


@pytest.mark.parametrize("name,kwargs", BAD_HEAD_SETTINGS, ids=range(len(BAD_HEAD_SETTINGS)))
def test_head_refuses_bad_settings(name, kwargs):
    h, w, y = _head()
    _raises(ValueError, name, lambda: linear_logprobs(h, w, y, backend="torch", **kwargs))
    _raises(ValueError, name, lambda: R.linear_logprobs(h, w, y, **kwargs))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "generic"])
@pytest.mark.parametrize("name,kwargs", FLOAT_SETTINGS, ids=range(len(FLOAT_SETTINGS)))
def test_losses_refuse_bad_head_settings(name, kwargs, fused):
    batch, h, W, b = make_batch(0)
    _raises(ValueError, name, lambda: L.ZVPCISPOLoss()(batch, hidden=h, weight=W, bias=b, fused=fused, **kwargs))


def test_temperature_tensor_that_requires_grad_is_refused_not_ignored():
    h, w, y = _head()
    t = torch.full((4,), 0.7, requires_grad=True)
    _raises(ValueError, "temperature requires grad", lambda: linear_logprobs(h, w, y, temperature=t))
    out = linear_logprobs(h, w, y, temperature=t.detach())  # the detached tensor is the documented way
    assert torch.isfinite(out.entropy).all()


@pytest.mark.parametrize(
    "name,make",
    [
        ("clip_eps_low", lambda: L.CISPOLoss(clip_eps_low=-0.5)),  # lower bound 1.5 above the upper 1.2
        ("clip_eps_low", lambda: L.CISPOLoss(clip_eps_low=NAN)),
        ("clip_eps_high", lambda: L.CISPOLoss(clip_eps_high=NAN)),
        ("clip_eps_low", lambda: L.TokenClippedSurrogateLoss(clip_eps_low=NAN)),
        ("clip_eps_high", lambda: L.TokenClippedSurrogateLoss(clip_eps_high=-0.1)),
        ("ratio_clip", lambda: L.TokenClippedSurrogateLoss(ratio_clip=NAN)),
        ("dual_clip", lambda: L.TokenClippedSurrogateLoss(dual_clip=NAN)),
        ("dual_clip", lambda: L.TokenClippedSurrogateLoss(dual_clip=1.0)),
        ("clip_eps_low", lambda: L.ClippedSurrogateLoss(clip_eps_low=NAN)),
        ("eps_max", lambda: L.ScaleRLLoss(eps_max=NAN)),
        ("tau_pos", lambda: L.SAPOLoss(tau_pos=NAN)),
        ("tau_neg", lambda: L.SAPOLoss(tau_neg=0.0)),
        ("alpha_zvp", lambda: L.ZVPCISPOLoss(alpha_zvp=NAN)),
    ],
    ids=range(13),
)
def test_loss_constructors_refuse_bad_settings(name, make):
    _raises(ValueError, name, make)


@pytest.mark.parametrize("path", ["fused", "generic", "logits"])
@pytest.mark.parametrize("direction", [2.0, 0.5, -3.0])
def test_zvp_direction_outside_its_values_is_not_read_by_its_sign(direction, path):
    """zvp_direction must be -1, 0 or +1: another value makes the loss NaN (no host sync in the loss), and the
    reference refuses it."""
    batch, h, W, b = make_batch(0)
    batch["zvp_direction"] = torch.tensor([1.0, direction, 0.0, -1.0])  # row 1 has action tokens
    loss_fn = L.ZVPCISPOLoss()
    if path == "logits":
        loss, _ = loss_fn(batch, logits=R.head_logits(h, W, b))
    else:
        loss, _ = loss_fn(batch, hidden=h, weight=W, bias=b, fused=path == "fused")
    assert bool(torch.isnan(loss))
    _raises(ValueError, "zvp_direction", lambda: R.ZVPCISPOLoss()(batch, logits=R.head_logits(h, W, b)))


@pytest.mark.parametrize("path", ["fused", "generic", "logits"])
def test_negative_action_mask_is_not_dropped_silently(path):
    """A negative action_mask entry (action selection reads `> 0`) makes the loss and its gradients NaN (no
    host sync in the loss); a valid mask keeps them finite."""
    batch, h, W, b = make_batch(0)
    for bad in (False, True):
        if bad:
            batch["action_mask"][1, 4] = -1.0
        loss_fn = L.CISPOLoss(entropy_coeff=0.01)
        if path == "logits":
            leaves = (h,)
            loss, _ = loss_fn(batch, logits=R.head_logits(h, W, b))
        else:
            leaves = (h, W, b)
            loss, _ = loss_fn(batch, hidden=h, weight=W, bias=b, fused=path == "fused")
        grads = torch.autograd.grad(loss, leaves)
        assert bool(torch.isnan(loss)) == bad
        assert all(bool(torch.isnan(g).any()) == bad for g in grads)
