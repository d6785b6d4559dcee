"""Deprecated path: the reward-model loss lives in `ludic_fast.losses.reward` (and `BradleyTerryLoss`,
`sequence_rewards` are exported by `ludic_fast.losses`). This module re-exports it."""

from __future__ import annotations

import warnings

from ludic_fast.losses.reward import *  # noqa: F403 - the moved module's public names
from ludic_fast.losses.reward import __all__  # noqa: F401

warnings.warn(
    "ludic_fast.reward_model is deprecated; import from ludic_fast.losses (or ludic_fast.losses.reward)",
    DeprecationWarning,
    stacklevel=2,
)
