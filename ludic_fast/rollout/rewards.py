"""Verifiable reward functions `reward(completion_text, answer) -> float` in [0, 1].

exact_match:   1 iff the stripped completion equals the stripped answer.
numeric_match: 1 iff the last number in the completion equals the answer numerically (|x - y| <= tol·max(1, |y|)).
format_reward: 1 iff the stripped completion matches a regular expression (fullmatch).
"""

from __future__ import annotations

import re
from collections.abc import Callable

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


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "numeric": numeric_match}


def get_reward(name: str) -> RewardFn:
    """A reward by name: "exact", "numeric", or "format:<regex>"."""
    if name.startswith("format:"):
        return format_reward(name[len("format:") :])
    if name not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)} or 'format:<regex>', got {name!r}")
    return REWARDS[name]


__all__ = ["RewardFn", "exact_match", "numeric_match", "format_reward", "last_number", "get_reward", "REWARDS"]
