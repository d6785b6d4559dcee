"""Adapters for the environment libraries people already have (docs/environments.md), one module each, each
importing its library only when used (an optional extra):

reasoning_gym: reasoning-gym datasets as prompt/answer RL tasks scored by their own `score_answer`.
textarena: textarena games as `ludic_fast.agents` environments (single-player, or against a fixed opponent).
verifiers: verifiers environments (`load_environment()` modules) driven by our sampler, scored by their rubric.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def import_library(module: str, extra: str, what: str) -> ModuleType:
    """`module`, imported on first use; an ImportError naming the extra that installs it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} need the {extra} package: pip install 'ludic-fast[{extra}]' ({exc})") from None
