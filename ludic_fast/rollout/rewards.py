"""Verifiable reward functions `reward(completion_text, answer) -> float` in [0, 1].

exact_match:   1 iff the stripped completion equals the stripped answer.
numeric_match: 1 iff the last number in the completion equals the answer numerically (|x - y| <= tol·max(1, |y|)).
format_reward: 1 iff the stripped completion matches a regular expression (fullmatch).

They are entries of the `REWARD_FUNCS` registry (`--reward NAME`); a user's own function is named by
`module:function`. `WeightedReward` sums several with weights, r = Σ_i w_i r_i, and reports each r_i.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ludic_fast.registry import Registry

RewardFn = Callable[[str, str], float]
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def exact_match(completion: str, answer: str) -> float:
    """1.0 iff `completion.strip() == answer.strip()`."""
    return float(completion.strip() == str(answer).strip())


def last_number(text: str) -> float | None:
    """The last decimal number written in `text` (commas as thousands separators ignored), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric_match(completion: str, answer: str, *, tol: float = 1e-6) -> float:
    """1.0 iff the completion's last number equals `answer` up to a relative tolerance."""
    got, want = last_number(completion), last_number(str(answer))
    if got is None or want is None:
        return 0.0
    return float(abs(got - want) <= tol * max(1.0, abs(want)))


def format_reward(pattern: str) -> RewardFn:
    """A reward of 1.0 when the stripped completion fully matches `pattern` (the answer is ignored)."""
    regex = re.compile(pattern, re.DOTALL)
    return lambda completion, answer: float(regex.fullmatch(completion.strip()) is not None)


@dataclass(frozen=True)
class RewardEntry:
    """A reward function in the registry: `make(arg)` returns the `RewardFn`; `arg` is the text after
    `name:` in a spec (`format:<regex>`) for an entry with `takes_arg`, else None."""

    name: str
    help: str
    make: Callable[[str | None], RewardFn]
    takes_arg: bool = False


def _user_reward(obj: Any, spec: str) -> RewardEntry:
    """A `module:function` spec: the user's `function(completion, answer) -> float`."""
    if isinstance(obj, RewardEntry):
        return obj
    if not callable(obj):
        raise TypeError(f"reward {spec!r}: expected a function (completion, answer) -> float, got {type(obj).__name__}")
    return RewardEntry(spec, f"{spec} (user function)", lambda _arg: obj)


#: the reward functions by name; `--reward NAME`, `--reward format:<regex>` or `--reward module:function`
REWARD_FUNCS: Registry[RewardEntry] = Registry("reward", coerce=_user_reward)
REWARD_FUNCS.add(RewardEntry("exact", "1 iff the stripped completion equals the stripped answer",
                             lambda _arg: exact_match))
REWARD_FUNCS.add(RewardEntry("numeric", "1 iff the completion's last number equals the answer (relative tol 1e-6)",
                             lambda _arg: numeric_match))
REWARD_FUNCS.add(RewardEntry("format", "format:<regex>: 1 iff the stripped completion fully matches the regex",
                             lambda arg: format_reward(arg or ""), takes_arg=True))

#: the registered functions that take no argument, by name (kept for code that reads this table)
REWARDS: dict[str, RewardFn] = {e.name: e.make(None) for e in REWARD_FUNCS if not e.takes_arg}


def get_reward(spec: str) -> RewardFn:
    """The reward function of a spec: a registered name ("exact", "numeric"), "format:<regex>", or a user's
    "module:function" (`function(completion, answer) -> float`). ValueError / TypeError naming a bad spec."""
    name, sep, arg = spec.partition(":")
    if sep and name in REWARD_FUNCS and REWARD_FUNCS[name].takes_arg:
        return REWARD_FUNCS[name].make(arg)
    entry = REWARD_FUNCS.resolve(spec)
    if entry.takes_arg:
        raise ValueError(f"reward {spec!r} takes an argument: {entry.name}:<arg>")
    return entry.make(None)


class WeightedReward:
    """Several reward functions with weights (TRL's `reward_funcs` + `reward_weights`): the reward is
    `Σ_i w_i r_i(completion, answer)`; `scores` also returns each component `r_i` by its spec."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] | None = None):
        specs = list(specs)
        if not specs:
            raise ValueError("WeightedReward needs at least one reward spec")
        weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(specs):
            raise ValueError(f"weights needs one weight per reward ({len(specs)}), got {len(weights)}")
        if len(set(specs)) != len(specs):
            raise ValueError(f"each reward may be given once, got {specs}")
        self.components = [(s, get_reward(s), w) for s, w in zip(specs, weights)]

    def scores(self, completion: str, answer: str) -> dict[str, float]:
        return {spec: float(fn(completion, answer)) for spec, fn, _ in self.components}

    def __call__(self, completion: str, answer: str) -> float:
        return sum(w * float(fn(completion, answer)) for _, fn, w in self.components)


def reward_from_specs(specs: Sequence[str], weights: Sequence[float] | None = None) -> RewardFn:
    """One spec with no weight: its function itself; else their `WeightedReward`."""
    if len(specs) == 1 and weights is None:
        return get_reward(specs[0])
    return WeightedReward(specs, weights)


__all__ = ["RewardFn", "RewardEntry", "REWARD_FUNCS", "exact_match", "numeric_match", "format_reward", "last_number",
           "get_reward", "REWARDS", "WeightedReward", "reward_from_specs"]
