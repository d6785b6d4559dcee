"""Credit assigners: Ludic's test cases, hand-derived batch-normalised / ZVP / GAE / shaping cases."""

from __future__ import annotations

import pytest

from ludic_fast.data.credit import (
    BatchNormalizedReturn,
    ConstantCredit,
    EpisodicReturn,
    GAEReturn,
    GroupNormalizedReturn,
    HybridNormalizedReturn,
    LinearLengthShaping,
    MonteCarloReturn,
    PerStepReward,
    PunitiveLengthShaping,
    ShapedCredit,
    SoftOverlongPunishment,
    ZVPGroupNormalizedReturn,
    soft_overlong_punishment,
)
from ludic_fast.data.types import Rollout, Step, TokenTrace


def _rollout(rewards, group=None, rid=None, completion_len=1, finish_reason=None, values=None):
    steps = [
        Step(
            index=i,
            prev_obs=None,
            action=None,
            next_obs=None,
            reward=r,
            trace=TokenTrace([0], [1] * completion_len, None, finish_reason),
            info={} if values is None else {"value": values[i]},
        )
        for i, r in enumerate(rewards)
    ]
    meta = {} if group is None else {"request_meta": {"group_id": group}}
    return Rollout(steps=steps, meta=meta) if rid is None else Rollout(steps=steps, meta=meta, id=rid)


def _weights(credit, rollouts):
    out = credit.compute(rollouts)
    return [out[(r.id, 0)] for r in rollouts]


# ------------------------------------------------------------------------------ Ludic's cases
def test_monte_carlo_gamma_one():
    r1, r2 = _rollout([0, 0, 1]), _rollout([-1])
    out = MonteCarloReturn().compute([r1, r2])
    assert len(out) == 4
    assert [out[(r1.id, i)] for i in range(3)] == [1, 1, 1]
    assert out[(r2.id, 0)] == -1


def test_monte_carlo_discounted():
    r = _rollout([1, 2, 4])
    out = MonteCarloReturn(gamma=0.9).compute([r])
    assert [out[(r.id, i)] for i in range(3)] == pytest.approx([6.04, 5.6, 4.0])


def test_episodic_and_per_step():
    r1, r2 = _rollout([0, 0, 1]), _rollout([-1, -0.5])
    ep = EpisodicReturn().compute([r1, r2])
    assert {ep[(r1.id, i)] for i in range(3)} == {1.0}
    assert {ep[(r2.id, i)] for i in range(2)} == {-1.5}
    r3 = _rollout([1, 2, 4])
    ps = PerStepReward().compute([r3])
    assert [ps[(r3.id, i)] for i in range(3)] == [1, 2, 4]
    assert ConstantCredit(2.5).compute([r3]) == {(r3.id, i): 2.5 for i in range(3)}


def test_group_normalized_groups_by_group_id():
    rs = [_rollout([10], "A"), _rollout([5], "B"), _rollout([20], "A"), _rollout([15], "B")]
    assert _weights(GroupNormalizedReturn(group_size=2), rs) == [-5, -5, 5, 5]


def test_group_normalized_zero_std_with_normalization_is_zero():
    rs = [_rollout([10], "A"), _rollout([10], "A")]
    assert _weights(GroupNormalizedReturn(group_size=2, normalize_adv=True), rs) == [0.0, 0.0]


def test_group_normalized_positive_only():
    rs = [_rollout([1], "A"), _rollout([0], "A")]
    assert _weights(GroupNormalizedReturn(group_size=2, positive_only=True), rs) == [0.5, 0.0]
    # hand-derived: clip first, then std of the clipped values (0.25) -> [2, 0]
    both = GroupNormalizedReturn(group_size=2, normalize_adv=True, positive_only=True)
    assert _weights(both, rs) == pytest.approx([2.0, 0.0], abs=1e-6)


@pytest.mark.parametrize(
    "credit", [GroupNormalizedReturn(2), HybridNormalizedReturn(2), ZVPGroupNormalizedReturn(2)]
)
def test_group_errors(credit):
    with pytest.raises(ValueError, match="missing group_id"):
        credit.compute([_rollout([1]), _rollout([0])])
    with pytest.raises(ValueError, match="Group size mismatch for group_id=A: expected 2, got 3"):
        credit.compute([_rollout([1], "A") for _ in range(3)])


@pytest.mark.parametrize("cls", [GroupNormalizedReturn, HybridNormalizedReturn, ZVPGroupNormalizedReturn])
@pytest.mark.parametrize("size", [0, -1])
def test_group_size_must_be_positive(cls, size):
    with pytest.raises(ValueError, match="group_size must be positive"):
        cls(group_size=size)


def test_group_size_four_with_three_rollouts():
    with pytest.raises(ValueError, match="Group size mismatch"):
        GroupNormalizedReturn(group_size=4).compute([_rollout([1], "A") for _ in range(3)])


# -------------------------------------------------------------------------- batch normalisation
def test_batch_normalized_hand_derived():
    assert BatchNormalizedReturn is HybridNormalizedReturn
    # groups A={1,0}, B={1,1}: centred [0.5,-0.5,0,0], population std over the batch = sqrt(0.125)
    rs = [_rollout([1], "A"), _rollout([0], "A"), _rollout([1], "B"), _rollout([1], "B")]
    s = 0.125**0.5
    assert _weights(BatchNormalizedReturn(2), rs) == pytest.approx([0.5 / s, -0.5 / s, 0, 0], rel=1e-6)
    assert _weights(BatchNormalizedReturn(2), rs)[0] == pytest.approx(1.414214, abs=1e-6)
    assert _weights(BatchNormalizedReturn(2, positive_only=True), rs) == pytest.approx([0.5 / s, 0, 0, 0], rel=1e-6)


def test_batch_normalized_differs_from_group_normalized():
    # A={3,1} (centred ±1), B={0,0.5} (centred ∓0.25): batch std = sqrt((1+1+1/16+1/16)/4) = sqrt(17/32)
    rs = [_rollout([3], "A"), _rollout([1], "A"), _rollout([0], "B"), _rollout([0.5], "B")]
    s = (17 / 32) ** 0.5
    assert _weights(BatchNormalizedReturn(2), rs) == pytest.approx([1 / s, -1 / s, -0.25 / s, 0.25 / s], rel=1e-6)
    assert _weights(GroupNormalizedReturn(2, normalize_adv=True), rs) == pytest.approx([1, -1, -1, 1], rel=1e-6)
    assert BatchNormalizedReturn(2).compute([]) == {}


def test_non_finite_total_reward_is_rejected():
    r = _rollout([1e308, 1e308], "A")  # each step reward finite, the sum overflows
    with pytest.raises(ValueError, match=f"non-finite reward inf for rollout id={r.id}"):
        GroupNormalizedReturn(1).compute([r])
    with pytest.raises(ValueError, match="non-finite reward"):
        MonteCarloReturn().compute([r])


# ---------------------------------------------------------------------------------------- ZVP
def test_zvp_positive_negative_and_mixed_groups():
    pos = [_rollout([1], "P") for _ in range(3)]
    neg = [_rollout([0], "N") for _ in range(3)]
    mixed = [_rollout([1], "M"), _rollout([0], "M"), _rollout([0], "M")]
    rs = [*pos, *neg, *mixed]
    credit = ZVPGroupNormalizedReturn(group_size=3)
    w = _weights(credit, rs)
    # mixed: centred [2/3, -1/3, -1/3], population std sqrt(2)/3 -> [sqrt(2), -1/sqrt(2), -1/sqrt(2)]
    assert w == pytest.approx([0] * 6 + [2**0.5, -(0.5**0.5), -(0.5**0.5)], rel=1e-5)
    assert [r.meta["zvp_direction"] for r in rs] == [1, 1, 1, -1, -1, -1, 0, 0, 0]
    assert credit.directions(rs) == {r.id: r.meta["zvp_direction"] for r in rs}


def test_zvp_all_negative_rewards_and_unnormalized():
    rs = [_rollout([-1], "N"), _rollout([-1], "N"), _rollout([2], "M"), _rollout([0], "M")]
    w = _weights(ZVPGroupNormalizedReturn(2, normalize_adv=False), rs)
    assert w == [0.0, 0.0, 1.0, -1.0]
    assert [r.meta["zvp_direction"] for r in rs] == [-1, -1, 0, 0]


def test_zvp_group_size_errors():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        ZVPGroupNormalizedReturn(group_size=1)
    with pytest.raises(ValueError, match="Group size mismatch for group_id=P: expected 4, got 2"):
        ZVPGroupNormalizedReturn(group_size=4).compute([_rollout([1], "P"), _rollout([1], "P")])


# ---------------------------------------------------------------------------------------- GAE
def test_gae_hand_derived():
    # r = [1, 0, 2], V = [0.5, 1.0, 1.5], γ = 0.9, λ = 0.8
    # δ2 = 2 - 1.5 = 0.5; δ1 = 0 + 0.9*1.5 - 1 = 0.35; δ0 = 1 + 0.9*1.0 - 0.5 = 1.4
    # A2 = 0.5; A1 = 0.35 + 0.72*0.5 = 0.71; A0 = 1.4 + 0.72*0.71 = 1.9112
    r = _rollout([1, 0, 2], values=[0.5, 1.0, 1.5])
    out = GAEReturn(gamma=0.9, lam=0.8, value_key="value").compute([r])
    assert [out[(r.id, i)] for i in range(3)] == pytest.approx([1.9112, 0.71, 0.5])


def test_gae_without_values_and_lambda_one_is_monte_carlo():
    r = _rollout([1, 2, 4])
    assert GAEReturn(gamma=0.9).compute([r]) == pytest.approx(MonteCarloReturn(gamma=0.9).compute([r]))
    with pytest.raises(ValueError, match="has no info\\['value'\\]"):
        GAEReturn(value_key="value").compute([r])
    with pytest.raises(ValueError, match="lam must lie in"):
        GAEReturn(lam=1.5)


# ------------------------------------------------------------------------------------ shaping
@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (21, -1.0), (1000, -1.0)],
)
def test_soft_overlong_punishment_three_regimes(length, expected):
    # L_max = 20, L_cache = 4: free up to 16, linear (16 - |y|)/4 in (16, 20], -1 beyond
    assert soft_overlong_punishment(length, max_length=20, cache_length=4) == pytest.approx(expected)


def test_soft_overlong_punishment_validates():
    with pytest.raises(ValueError, match="cache_length"):
        SoftOverlongPunishment(max_length=10, cache_length=0)
    with pytest.raises(ValueError, match="cache_length"):
        SoftOverlongPunishment(max_length=10, cache_length=11)


def test_shaped_credit_adds_bonus_to_last_step_before_inner():
    short = _rollout([0.0, 1.0], "A", completion_len=4)  # |y| = 8 -> free
    long = _rollout([0.0, 1.0], "A", completion_len=9)  # |y| = 18 -> -0.5
    shaped = ShapedCredit(EpisodicReturn(), [SoftOverlongPunishment(max_length=20, cache_length=4)])
    out = shaped.compute([short, long])
    assert out[(short.id, 0)] == out[(short.id, 1)] == 1.0
    assert out[(long.id, 0)] == out[(long.id, 1)] == 0.5
    assert long.steps[1].reward == 1.0  # the caller's rollouts are untouched


def test_linear_and_punitive_length_shaping():
    ok = _rollout([1.0], "A", completion_len=5)
    cut = _rollout([1.0], "A", completion_len=5, finish_reason="length")
    over = _rollout([1.0], "A", completion_len=11)
    lin = ShapedCredit(EpisodicReturn(), [LinearLengthShaping(max_length=10, coef=0.2)])
    assert _weights(lin, [ok, over]) == pytest.approx([0.9, 1 - 0.22])
    pun = ShapedCredit(EpisodicReturn(), [PunitiveLengthShaping(max_length=10, reward=-1.0)])
    assert _weights(pun, [ok, cut, over]) == [1.0, -1.0, -1.0]


def test_shaped_credit_keeps_meta_shared_for_zvp():
    rs = [_rollout([1.0], "P", completion_len=2), _rollout([1.0], "P", completion_len=2)]
    ShapedCredit(ZVPGroupNormalizedReturn(2), [LinearLengthShaping(max_length=10, coef=0.0)]).compute(rs)
    assert [r.meta["zvp_direction"] for r in rs] == [1, 1]
