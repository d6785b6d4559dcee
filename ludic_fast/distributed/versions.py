"""Policy versions that only go up, across learner restarts, as the actors see them.

The learner publishes its weights after every step with a version; actors load a version only when it is
higher than the one they hold, and tag their items with it (staleness, `max_lag`, is measured in versions).
A learner resumed from the checkpoint of step k after it had published up to version m > k must not publish
k + 1 again: the actors would ignore it (and would keep sampling with the lost lineage's weights). The rule:

    start = max(checkpoint's version, version published in Redis) + 1   (0 when neither exists)
    version of step s = start + (s - step at start)

so the restored weights are published at once as `start`, a version no actor has loaded, and every later
step one higher. A fresh learner (step 0, nothing published) publishes 0, 1, 2, ... = its steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def start_version(checkpoint_version: int | None, published: int | None) -> int:
    """The first version a (re)started learner publishes: one above both arguments, 0 when both are None."""
    known = [v for v in (checkpoint_version, published) if v is not None]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in known):
        raise ValueError(f"versions must be non-negative ints or None, got {checkpoint_version!r}, {published!r}")
    return max(known) + 1 if known else 0


class OffsetPublisher:
    """A publisher that publishes the Trainer's step `s` as version `s + offset` through `inner`
    (`offset = start_version(...) - step at start`, module docstring)."""

    def __init__(self, inner: Any, offset: int = 0):
        if not callable(getattr(inner, "publish", None)):
            raise TypeError("inner must have a publish(params, version) method")
        self.inner, self.offset = inner, offset

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        self.inner.publish(params, version + self.offset)
