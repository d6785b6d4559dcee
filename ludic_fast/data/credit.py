"""Credit assigners: every step of every rollout -> a scalar weight (its advantage), plus reward shaping.

All assigners return `{(rollout.id, step.index): float}` covering every step. Group-based assigners read
the group from `rollout.meta['request_meta']['group_id']` (set by `GRPORequestStrategy`; the flattened
`meta['group_id']` is accepted too), iterate groups in order of first appearance, and require exactly
`group_size` rollouts per group. A rollout's reward is `R = rollout.total_reward`; a non-finite R is a
ValueError naming the rollout. Arithmetic follows Ludic master: group statistics in float32, population
std.

Group-based, per group g with rewards R_i (i ∈ g):
- GroupNormalizedReturn:  a_i = R_i − mean_g R; [positive_only] a = max(a, 0); [normalize_adv]
  a = a / (std_g(a) + 1e-8).
- HybridNormalizedReturn (= BatchNormalizedReturn, ScaleRL): a_i = R_i − mean_g R, then
  adv_i = a_i / (std over ALL rollouts of the batch of a + eps); [positive_only] max(adv, 0) after scaling.
- ZVPGroupNormalizedReturn (RL-ZVP): a zero-variance group (std_g R ≤ eps) gets weight 0 and
  `zvp_direction` = +1 when its common reward is > 0 (all correct), −1 otherwise (all wrong); other
  groups get GroupNormalizedReturn's weight and direction 0. The direction is written to
  `rollout.meta['zvp_direction']`; item builders copy rollout meta into item meta (Ludic's rule), and
  `collate_saw_items` turns it into `batch['zvp_direction']` [B] for `ZVPCISPOLoss`.
Per rollout:
- MonteCarloReturn(γ):  w_t = Σ_{k≥t} γ^{k−t} r_k.
- GAEReturn(γ, λ):      w_t = Σ_{k≥t} (γλ)^{k−t} δ_k, δ_k = r_k + γ V_{k+1} − V_k, V past the end = 0
  (V ≡ 0 without per-step values; then λ = 1 gives MonteCarloReturn).
- EpisodicReturn: w_t = R.  PerStepReward: w_t = r_t.  ConstantCredit(c): w_t = c.
Shaping (`ShapedCredit(inner, shapings)`): each shaping adds a bonus to the last step's reward, from the
rollout's completion length |y| = Σ_steps len(trace.completion_token_ids), before `inner` runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ludic_fast.data.types import CreditAssigner, Rollout, RolloutStepKey, group_id_of

CreditMap = dict[RolloutStepKey, float]


# --------------------------------------------------------------------------------------------- helpers
def _reward(rollout: Rollout) -> float:
    reward = rollout.total_reward
    if not math.isfinite(reward):
        raise ValueError(f"non-finite reward {reward} for rollout id={rollout.id}")
    return float(reward)


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size!r}")


def _groups(rollouts: Sequence[Rollout], group_size: int) -> list[list[Rollout]]:
    """Rollouts bucketed by group id in order of first appearance; every bucket has exactly group_size."""
    buckets: dict[str, list[Rollout]] = {}
    for r in rollouts:
        gid = group_id_of(r.meta)
        if gid is None:
            raise ValueError(
                f"rollout id={r.id} is missing group_id in meta['request_meta'] "
                "(group-based credit needs GRPORequestStrategy or an explicit group_id)"
            )
        buckets.setdefault(gid, []).append(r)
    for gid, members in buckets.items():
        if len(members) != group_size:
            raise ValueError(f"Group size mismatch for group_id={gid}: expected {group_size}, got {len(members)}.")
    return list(buckets.values())


def _broadcast(rollout: Rollout, value: float, out: CreditMap) -> None:
    for step in rollout.steps:
        out[(rollout.id, step.index)] = value


def _pop_std(x: torch.Tensor) -> torch.Tensor:
    return x.std(unbiased=False) if x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def _group_centred(members: Sequence[Rollout]) -> torch.Tensor:
    rewards = torch.tensor([_reward(r) for r in members], dtype=torch.float32)
    return rewards - rewards.mean()


def _group_normalized(members: Sequence[Rollout], normalize_adv: bool, positive_only: bool) -> torch.Tensor:
    adv = _group_centred(members)
    if positive_only:
        adv = adv.clamp(min=0.0)
    if normalize_adv:
        adv = adv / (_pop_std(adv) + 1e-8)
    return adv


# ------------------------------------------------------------------------------------ group assigners
@dataclass
class GroupNormalizedReturn:
    """GRPO: a_i = R_i − mean_g R; [positive_only] max(a, 0) first; [normalize_adv] / (std_g(a) + 1e-8)."""

    group_size: int
    normalize_adv: bool = False
    positive_only: bool = False

    def __post_init__(self) -> None:
        _check_group_size(self.group_size)

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        out: CreditMap = {}
        for members in _groups(rollouts, self.group_size):
            adv = _group_normalized(members, self.normalize_adv, self.positive_only)
            for r, a in zip(members, adv.tolist(), strict=True):
                _broadcast(r, a, out)
        return out


@dataclass
class HybridNormalizedReturn:
    """ScaleRL batch normalisation: adv_i = (R_i − mean_g R) / (std_batch(R − mean_g R) + eps).

    The std is the population std over every rollout of the call (zero-variance groups contribute zeros);
    [positive_only] clamps at 0 after scaling.
    """

    group_size: int
    eps: float = 1e-8
    positive_only: bool = False

    def __post_init__(self) -> None:
        _check_group_size(self.group_size)
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        if not rollouts:
            return {}
        groups = _groups(rollouts, self.group_size)
        centred = [_group_centred(members) for members in groups]
        sigma = float(_pop_std(torch.cat(centred)))
        out: CreditMap = {}
        for members, adv in zip(groups, centred, strict=True):
            for r, a in zip(members, adv.tolist(), strict=True):
                value = a / (sigma + self.eps)
                _broadcast(r, max(value, 0.0) if self.positive_only else value, out)
        return out


BatchNormalizedReturn = HybridNormalizedReturn


@dataclass
class ZVPGroupNormalizedReturn:
    """RL-ZVP credit: zero-variance groups get weight 0 and a direction; the rest are GRPO-normalised.

    A group is zero-variance when std_g(R) ≤ eps. Its direction is +1 when the shared reward is > 0 (all
    correct) and −1 otherwise (all wrong); every other group has direction 0 and weight
    GroupNormalizedReturn(group_size, normalize_adv, positive_only). `compute` writes the direction to
    `rollout.meta['zvp_direction']` (see the module docstring for how it reaches the batch).
    """

    group_size: int
    normalize_adv: bool = True
    positive_only: bool = False
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_group_size(self.group_size)
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for zero-variance detection, got {self.group_size}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")

    def _direction(self, members: Sequence[Rollout]) -> int:
        rewards = torch.tensor([_reward(r) for r in members], dtype=torch.float32)
        if float(_pop_std(rewards)) > self.eps:
            return 0
        return 1 if float(rewards.mean()) > 0 else -1

    def directions(self, rollouts: Sequence[Rollout]) -> dict[str, int]:
        """{rollout.id: +1 | 0 | −1} without touching the rollouts."""
        return {
            r.id: direction
            for members in _groups(rollouts, self.group_size)
            for direction in [self._direction(members)]
            for r in members
        }

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        out: CreditMap = {}
        for members in _groups(rollouts, self.group_size):
            direction = self._direction(members)
            adv = _group_normalized(members, self.normalize_adv, self.positive_only)
            for r, a in zip(members, adv.tolist(), strict=True):
                r.meta["zvp_direction"] = direction
                _broadcast(r, 0.0 if direction else a, out)
        return out


# ---------------------------------------------------------------------------------- per-rollout credit
def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


@dataclass
class MonteCarloReturn:
    """w_t = Σ_{k≥t} γ^{k−t} r_k over the rollout's steps in list order (float64)."""

    gamma: float = 1.0

    def __post_init__(self) -> None:
        _check_discount("gamma", self.gamma)

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        out: CreditMap = {}
        for r in rollouts:
            _reward(r)
            ret = 0.0
            for step in reversed(r.steps):
                ret = step.reward + self.gamma * ret
                out[(r.id, step.index)] = ret
        return out


@dataclass
class GAEReturn:
    """Generalised advantage estimation over a multi-step rollout.

    w_t = Σ_{k≥t} (γλ)^{k−t} δ_k,  δ_k = r_k + γ V_{k+1} − V_k,  V after the last step = 0.
    V_k is `float(step.info[value_key])` when `value_key` is set (a missing or non-finite value is a
    ValueError), else 0 — then w_t is the γλ-discounted return, and λ = 1 gives MonteCarloReturn(γ).
    """

    gamma: float = 1.0
    lam: float = 1.0
    value_key: str | None = None

    def __post_init__(self) -> None:
        _check_discount("gamma", self.gamma)
        _check_discount("lam", self.lam)

    def _value(self, rollout: Rollout, step_pos: int) -> float:
        if self.value_key is None:
            return 0.0
        step = rollout.steps[step_pos]
        if self.value_key not in step.info:
            raise ValueError(f"step {step.index} of rollout id={rollout.id} has no info[{self.value_key!r}]")
        value = float(step.info[self.value_key])
        if not math.isfinite(value):
            raise ValueError(f"non-finite value estimate info[{self.value_key!r}] at step {step.index}")
        return value

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        out: CreditMap = {}
        for r in rollouts:
            _reward(r)
            adv, next_value = 0.0, 0.0
            for pos in range(len(r.steps) - 1, -1, -1):
                value = self._value(r, pos)
                delta = r.steps[pos].reward + self.gamma * next_value - value
                adv = delta + self.gamma * self.lam * adv
                out[(r.id, r.steps[pos].index)] = adv
                next_value = value
        return out


@dataclass
class EpisodicReturn:
    """Every step gets the rollout's total reward."""

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        out: CreditMap = {}
        for r in rollouts:
            _broadcast(r, _reward(r), out)
        return out


@dataclass
class PerStepReward:
    """Every step gets its own reward."""

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        return {(r.id, s.index): float(s.reward) for r in rollouts for s in r.steps}


@dataclass
class ConstantCredit:
    """Every step gets `value` (SFT)."""

    value: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.value):
            raise ValueError(f"value must be finite, got {self.value}")

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        out: CreditMap = {}
        for r in rollouts:
            _broadcast(r, float(self.value), out)
        return out


# ------------------------------------------------------------------------------------- reward shaping
def completion_length(rollout: Rollout) -> int:
    """|y| = Σ over steps of len(trace.completion_token_ids); every step needs a trace."""
    total = 0
    for step in rollout.steps:
        if step.trace is None:
            raise ValueError(f"length shaping needs step.trace; step {step.index} of rollout id={rollout.id} has none")
        total += len(step.trace.completion_token_ids)
    return total


def soft_overlong_punishment(length: int, *, max_length: int, cache_length: int) -> float:
    """DAPO Eq. 13: 0 if |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|) / L_cache up to L_max; −1 beyond."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got cache_length={cache_length}, max={max_length}")
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


@dataclass
class SoftOverlongPunishment:
    """DAPO soft overlong punishment added to the reward (see `soft_overlong_punishment`)."""

    max_length: int
    cache_length: int

    def __post_init__(self) -> None:
        soft_overlong_punishment(0, max_length=self.max_length, cache_length=self.cache_length)

    def __call__(self, rollout: Rollout, length: int) -> float:
        return soft_overlong_punishment(length, max_length=self.max_length, cache_length=self.cache_length)


@dataclass
class LinearLengthShaping:
    """Linear length penalty: bonus = −coef · |y| / max_length."""

    max_length: int
    coef: float = 1.0

    def __post_init__(self) -> None:
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")

    def __call__(self, rollout: Rollout, length: int) -> float:
        return -self.coef * length / self.max_length


@dataclass
class PunitiveLengthShaping:
    """Overlong responses get a fixed reward: R ← `reward` when |y| > max_length or any step's trace
    finished with finish_reason == 'length' (bonus = reward − R); others are unchanged."""

    max_length: int
    reward: float = -1.0

    def __post_init__(self) -> None:
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")

    def __call__(self, rollout: Rollout, length: int) -> float:
        hit_limit = any(s.trace is not None and s.trace.finish_reason == "length" for s in rollout.steps)
        return self.reward - _reward(rollout) if length > self.max_length or hit_limit else 0.0


Shaping = Callable[[Rollout, int], float]


@dataclass
class ShapedCredit:
    """Adds Σ shaping(rollout, |y|) to each rollout's last-step reward, then runs `inner` on the result.

    Every bonus is computed on the unshaped rollout, then they are summed.

    The shaped rollouts share ids and `meta` with the originals, so keys and meta written by `inner`
    (e.g. `zvp_direction`) land on the caller's rollouts.
    """

    inner: CreditAssigner
    shapings: Sequence[Shaping] = field(default_factory=list)

    def shaped(self, rollouts: Sequence[Rollout]) -> list[Rollout]:
        out = []
        for r in rollouts:
            if not r.steps or not self.shapings:
                out.append(r)
                continue
            length = completion_length(r)
            bonus = sum(shape(r, length) for shape in self.shapings)
            last = dataclasses.replace(r.steps[-1], reward=r.steps[-1].reward + bonus)
            shaped = Rollout(steps=[*r.steps[:-1], last], id=r.id)
            shaped.meta = r.meta
            out.append(shaped)
        return out

    def compute(self, rollouts: Sequence[Rollout]) -> CreditMap:
        return self.inner.compute(self.shaped(rollouts))


__all__ = [
    "CreditMap",
    "GroupNormalizedReturn",
    "HybridNormalizedReturn",
    "BatchNormalizedReturn",
    "ZVPGroupNormalizedReturn",
    "MonteCarloReturn",
    "GAEReturn",
    "EpisodicReturn",
    "PerStepReward",
    "ConstantCredit",
    "completion_length",
    "soft_overlong_punishment",
    "SoftOverlongPunishment",
    "LinearLengthShaping",
    "PunitiveLengthShaping",
    "ShapedCredit",
]
