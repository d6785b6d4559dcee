"""Ludic's own loss test cases and the hand-derived checks, run
against `ludic_fast.reference` — the spec every fused loss is then tested against."""

from __future__ import annotations

import math

import pytest
import torch

from ludic_fast import reference as R

LN_HALF = math.log(0.5)


def _batch(ids, mask, weight=None, **extra):
    b = {
        "input_ids": torch.tensor(ids),
        "action_mask": torch.tensor(mask, dtype=torch.float32),
        "attention_mask": torch.ones(len(ids), len(ids[0]), dtype=torch.long),
    }
    if weight is not None:
        b["weight"] = torch.tensor(weight, dtype=torch.float32)
    b.update({k: torch.tensor(v, dtype=torch.float32) for k, v in extra.items()})
    return b


def _lsm(row, i):
    return float(torch.log_softmax(torch.tensor(row, dtype=torch.float64), -1)[i])


def test_compute_logp_action():
    logits = torch.tensor([[[1.0, 1, 3, 1], [4, 2, 1, 1], [1, 5, 1, 1]]])
    L = R.compute_logp_action(logits, torch.tensor([[2, 0, 1]]), torch.tensor([[0, 1, 1]]))
    expected = _lsm([1, 1, 3, 1], 0) + _lsm([4, 2, 1, 1], 1)
    assert abs(expected - (-4.55175)) < 1e-3
    assert abs(float(L[0]) - expected) < 1e-5


def test_compute_logp_action_multitoken_and_norm():
    logits = torch.tensor([[[0.0, 0], [1, 0], [0, 2], [3, 0]]])
    ids, mask = torch.tensor([[0, 1, 0, 1]]), torch.tensor([[0, 0, 1, 1]])
    assert float(R.compute_logp_action(logits, ids, mask)[0]) == pytest.approx(-0.440190, abs=1e-5)
    assert float(R.compute_logp_action(logits, ids, mask, length_normalize=True)[0]) == pytest.approx(
        -0.220095, abs=1e-5
    )


def test_reinforce_loss():
    logits = torch.tensor([[[1.0, 2], [3, 1]]])
    L = _lsm([1, 2], 0)  # token 1 (= id 0) scored by position 0
    batch = _batch([[1, 0]], [[0, 1]], [2.0], old_logp_action=[L])
    loss, stats = R.ReinforceLoss()(batch, logits=logits)
    assert float(loss) == pytest.approx(2.626523, abs=1e-5)
    assert float(stats["adv_mean"]) == 2.0
    assert float(stats["logp_mean"]) == pytest.approx(-1.3133, abs=1e-4)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0)
    assert float(stats["kl_actor_policy"]) == pytest.approx(0.0, abs=1e-7)


def test_reinforce_loss_off_policy():
    batch = _batch([[0, 1]], [[0, 1]], [1.0], old_logp_action=[LN_HALF - math.log(2)])
    loss, stats = R.ReinforceLoss()(batch, logits=torch.zeros(1, 2, 2))
    assert float(loss) == pytest.approx(1.386294, abs=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(2.0, abs=1e-5)


def test_reinforce_loss_requires_old_logp():
    with pytest.raises(KeyError, match="old_logp_action"):
        R.ReinforceLoss()(_batch([[0, 1]], [[0, 1]], [1.0]), logits=torch.zeros(1, 2, 2))


@pytest.mark.parametrize("normalize,expected", [(False, 0.25), (True, 0.5)])
def test_reinforce_baseline_loss(normalize, expected):
    logits = torch.tensor([[[1.0, 2], [3, 1]], [[2, 1], [1, 2]]])
    ids = [[1, 0], [0, 0]]
    L = R.compute_logp_action(logits, torch.tensor(ids), torch.tensor([[0, 1], [0, 1]]))
    torch.testing.assert_close(L, torch.tensor([-1.313262, -0.313262]), atol=1e-5, rtol=0)
    batch = _batch(ids, [[0, 1], [0, 1]], [1.5, 0.5], old_logp_action=L.tolist())
    loss, stats = R.ReinforceBaselineLoss(normalize=normalize)(batch, logits=logits)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert float(stats["baseline"]) == pytest.approx(1.0)
    assert float(stats["adv_mean"]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("ln,expected", [(False, -0.440399), (True, -0.663625)])
def test_gspo_loss_length_normalize_affects_ratio(ln, expected):
    logits = torch.tensor([[[0.0, 0], [2, 0], [0, 0]]])
    batch = _batch([[0, 1, 0]], [[0, 1, 1]], [1.0], old_logp_action=[0.0])
    loss, _ = R.ClippedSurrogateLoss(1.0, 1.0, length_normalize=ln)(batch, logits=logits)
    assert float(loss) == pytest.approx(expected, abs=1e-5)


def _one_token(ratio, adv):
    """V=2 zero logits (ℓ = ln 0.5), one action token, behaviour logp chosen for the given ratio."""
    old = LN_HALF - math.log(ratio)
    return _batch([[0, 1]], [[0, 1]], [adv], old_logp_action=[old], actor_logps=[[0.0, old]])


@pytest.mark.parametrize(
    "ratio,adv,eps,clip,expected",
    [(2.0, 1.0, 0.1, None, -1.1), (0.5, -1.0, 0.2, None, 0.8), (10.0, 1.0, 10.0, 2.0, -2.0)],
)
def test_gspo_loss_clipping(ratio, adv, eps, clip, expected):
    loss, _ = R.ClippedSurrogateLoss(eps, eps, ratio_clip=clip)(_one_token(ratio, adv), logits=torch.zeros(1, 2, 2))
    assert float(loss) == pytest.approx(expected, abs=1e-5)


def test_grpo_token_loss_upper_clip():
    loss, _ = R.TokenClippedSurrogateLoss(0.1, 0.1)(_one_token(2.0, 1.0), logits=torch.zeros(1, 2, 2))
    assert float(loss) == pytest.approx(-1.1, abs=1e-5)


def test_cispo_loss_basic():
    loss, stats = R.CISPOLoss()(_one_token(1.0, 2.0), logits=torch.zeros(1, 2, 2))
    assert float(loss) == pytest.approx(1.386294, abs=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0)
    assert float(stats["clip_frac"]) == 0.0
    assert float(stats["adv_mean"]) == 2.0


def test_cispo_loss_clips_high_ratio():
    loss, stats = R.CISPOLoss(clip_eps_high=0.1)(_one_token(2.0, 1.0), logits=torch.zeros(1, 2, 2))
    assert float(loss) == pytest.approx(0.762462, abs=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(2.0, abs=1e-5)
    assert float(stats["clip_frac"]) == 1.0


def test_cispo_loss_no_lower_clip_by_default():
    loss, stats = R.CISPOLoss()(_one_token(0.1, -1.0), logits=torch.zeros(1, 2, 2))
    assert float(loss) == pytest.approx(-0.0693147, abs=1e-6)
    assert float(stats["ratio_mean"]) == pytest.approx(0.1, abs=1e-6)
    assert float(stats["clip_frac"]) == 0.0


def test_cispo_loss_length_normalize():
    batch = _batch([[0, 1, 0]], [[0, 1, 1]], [1.0], actor_logps=[[0.0, LN_HALF, LN_HALF]])
    ln, stats = R.CISPOLoss(length_normalize=True)(batch, logits=torch.zeros(1, 3, 2))
    raw, _ = R.CISPOLoss(length_normalize=False)(batch, logits=torch.zeros(1, 3, 2))
    assert float(raw) == pytest.approx(2 * float(ln))
    assert float(stats["avg_action_tokens"]) == 2.0


def test_cispo_loss_gradient_only_through_logp():
    logits = torch.zeros(1, 2, 2, requires_grad=True)
    loss, _ = R.CISPOLoss(clip_eps_high=0.5)(_one_token(2.0, 1.0), logits=logits)
    (grad,) = torch.autograd.grad(loss, logits)
    # d/dz of -w A ℓ at p = (0.5, 0.5), target 1: -w A (onehot - p) with w = clip(2, ., 1.5) = 1.5
    torch.testing.assert_close(grad[0, 0], torch.tensor([0.75, -0.75]))
    assert float(grad[0, 1].abs().sum()) == 0.0


def test_cispo_requires_actor_logps():
    with pytest.raises(KeyError, match="actor_logps"):
        R.CISPOLoss()(_batch([[0, 1]], [[0, 1]], [1.0]), logits=torch.zeros(1, 2, 2))


class MockLoss:
    def __init__(self, value, stats):
        self.value, self.stats = value, stats

    def compute(self, logits, batch):
        return torch.tensor(self.value), {"loss": torch.tensor(self.value), **self.stats}


def test_composite_loss():
    terms = [
        R.LossTerm("ppo", MockLoss(10.0, {"clip_frac": 0.1}), 1.0),
        R.LossTerm("kl", MockLoss(4.0, {"kl_mean": 0.5}), 0.5),
    ]
    loss, stats = R.CompositeLoss(terms)(_batch([[0, 1]], [[0, 1]], [1.0]), logits=torch.zeros(1, 2, 2))
    assert float(loss) == 12.0
    plain = {k: float(v) for k, v in stats.items()}
    assert plain == {
        "loss": 12.0, "ppo/loss": 10.0, "ppo/weight": 1.0, "ppo/clip_frac": 0.1,
        "kl/loss": 4.0, "kl/weight": 0.5, "kl/kl_mean": 0.5,
    }  # fmt: skip


def test_composite_loss_needs_terms():
    with pytest.raises(ValueError, match="LossTerm"):
        R.CompositeLoss([])


# ------------------------------------------------------------------ setup E (hand-derived numbers)
def _setup_e(adv=1.0):
    """B=1, T=3, V=2, zero logits; ids [0,1,0], mask [0,1,1]; token ratios r = [2.0, 0.5]."""
    actor = [0.0, LN_HALF - math.log(2.0), 0.0]  # r = [exp(ln 2), exp(ln 0.5)]
    batch = _batch([[0, 1, 0]], [[0, 1, 1]], [adv], actor_logps=[actor], old_logp_action=[sum(actor)])
    return batch, torch.zeros(1, 3, 2)


@pytest.mark.parametrize("adv,ln,expected", [(1.0, False, -1.77), (1.0, True, -0.885), (-1.0, False, 2.8)])
def test_token_clipped_setup_e(adv, ln, expected):
    batch, logits = _setup_e(adv)
    loss, stats = R.TokenClippedSurrogateLoss(0.2, 0.27, length_normalize=ln)(batch, logits=logits)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert float(stats["clip_frac"]) == 1.0
    assert float(stats["ratio_mean"]) == pytest.approx(1.25, abs=1e-6)
    assert float(stats["ratio_std"]) == pytest.approx(0.75, abs=1e-6)
    assert float(stats["kl_actor_policy"]) == pytest.approx(0.25, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs,expected",
    [({}, 0.589175), ({"length_normalize": False}, 1.178350), ({"clip_eps_low": 0.2, "clip_eps_high": 0.28}, 0.720873)],
)
def test_cispo_setup_e(kwargs, expected):
    batch, logits = _setup_e()
    loss, stats = R.CISPOLoss(**kwargs)(batch, logits=logits)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    if not kwargs:
        assert float(stats["clip_frac"]) == 0.5


@pytest.mark.parametrize("adv,ln", [(1.0, False), (1.0, True), (-2.0, False)])
def test_clipped_surrogate_setup_e_on_policy_sequence(adv, ln):
    batch, logits = _setup_e(adv)
    loss, _ = R.ClippedSurrogateLoss(length_normalize=ln)(batch, logits=logits)
    assert float(loss) == pytest.approx(-adv, abs=1e-5)


def test_token_kl_setup_e():
    batch, logits = _setup_e()
    loss, stats = R.TokenKLLoss(coeff=0.01)(batch, logits=logits)
    assert float(loss) == pytest.approx(0.0, abs=1e-7)
    assert float(stats["kl_mean"]) == pytest.approx(0.0, abs=1e-7)
    assert float(stats["kl_std"]) == pytest.approx(0.693147, abs=1e-6)
    assert float(stats["ratio_mean"]) == pytest.approx(1.25, abs=1e-6)


@pytest.mark.parametrize("ln,expected", [(True, 0.693147), (False, 1.386294)])
def test_masked_causal_lm_ce_setup_e(ln, expected):
    batch, logits = _setup_e()
    loss, _ = R.MaskedCausalLMCrossEntropyLoss(length_normalize=ln)(batch, logits=logits)
    assert float(loss) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("shifted", [True, False])
def test_entropy_bonus_setup_e(shifted):
    batch, logits = _setup_e()
    loss, stats = R.EntropyBonus(0.01, shifted=shifted)(batch, logits=logits)
    assert float(loss) == pytest.approx(-0.0069315, abs=1e-7)
    assert float(stats["entropy_mean"]) == pytest.approx(math.log(2), abs=1e-6)


def test_entropy_bonus_alignment_differs_from_ludic():
    """Ours reads H at the position that scores each action token; Ludic's reads it one position late."""
    logits = torch.tensor([[[0.0, 0.0], [5.0, -5.0], [0.0, 0.0]]])
    batch = _batch([[0, 1, 0]], [[0, 1, 0]], [1.0])
    ours, s_ours = R.EntropyBonus(1.0)(batch, logits=logits)
    ludic, s_ludic = R.EntropyBonus(1.0, shifted=False)(batch, logits=logits)
    assert float(s_ours["entropy_mean"]) == pytest.approx(math.log(2), abs=1e-6)  # position 0 scores token 1
    assert float(s_ludic["entropy_mean"]) < 1e-3  # position 1: a confident distribution
