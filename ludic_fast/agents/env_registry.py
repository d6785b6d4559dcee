"""The environments `ludic-fast train --env` knows by name, as a `Registry` (ludic_fast.registry): the embedded
ones, and a third party's factory by module path (`--env my_pkg.envs:make_env`, any callable returning an
environment)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ludic_fast.agents.embedded_envs import CalculatorEnv, GuessNumberEnv
from ludic_fast.registry import Registry


@dataclass(frozen=True)
class EnvEntry:
    """An environment factory (called once per episode with the --env-arg keywords), its name and help."""

    name: str
    help: str
    factory: Callable[..., Any]


def _user_env(obj: Any, spec: str) -> EnvEntry:
    if isinstance(obj, EnvEntry):
        return obj
    if not callable(obj):
        raise TypeError(f"env {spec!r} is not callable (expected a factory returning an environment)")
    return EnvEntry(spec, f"{spec} (user factory)", obj)


ENVS: Registry[EnvEntry] = Registry("env", coerce=_user_env)
ENVS.add(EnvEntry("embedded-guess", "guess a digit with higher/lower feedback (multi-turn)", GuessNumberEnv))
ENVS.add(EnvEntry("embedded-calc", "two-digit products with a calc tool (tool calls)", CalculatorEnv))

__all__ = ["EnvEntry", "ENVS"]
