"""verifiers environments as environments of `ludic_fast.agents`: the `--env` factory for every supported release.

verifiers (https://github.com/PrimeIntellect-ai/verifiers) 0.3.1, its classic API (`verifiers_v031`:
`VerifiersEnv` over a `load_environment()` module), and 0.4.0, its `verifiers.v1` tasksets and envs
(`verifiers_v04`); any other installed release is refused in one line naming the supported ones.

`make_env(env, split="train", **env_args)` is the factory: `--env ludic_fast.agents.libraries.verifiers:make_env
--env-arg env=my_env.py`; it reads the installed release and builds that release's environment.
"""

from __future__ import annotations

from typing import Any

from ludic_fast.agents.libraries import verifiers_v04
from ludic_fast.agents.libraries.verifiers_v031 import (
    MODEL_NAME,
    SPLITS,
    SUPPORTED_VERSIONS,
    VerifiersEnv,
    check_runnable,
    installed_version,
    load,
    to_message,
    tool_schema,
)


def make_env(env: str, split: str = "train", **env_args: Any) -> VerifiersEnv:
    """The `--env` factory: under verifiers 0.3.1 a `VerifiersEnv` of `load(env, **env_args)`, under 0.4.0
    `verifiers_v04.make_env(env, split, **env_args)`; ValueError (one line) for any other release."""
    if installed_version() == "0.4.0":
        return verifiers_v04.make_env(env, split, **env_args)
    return VerifiersEnv(load(env, **env_args), split=split)


__all__ = ["MODEL_NAME", "SPLITS", "SUPPORTED_VERSIONS", "VerifiersEnv", "check_runnable", "installed_version", "load",
           "make_env", "to_message", "tool_schema"]
