"""Old names kept working: a module's `__getattr__` that returns a renamed attribute under its old name with a
DeprecationWarning naming the new one."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


def renamed_attributes(module: str, namespace: dict[str, Any], renamed: dict[str, str]) -> Callable[[str], Any]:
    """`__getattr__` for `module` (its `__name__`): `old` -> `namespace[renamed[old]]` with a DeprecationWarning
    "old is deprecated: use module.new"; AttributeError for any other missing name."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            warnings.warn(f"{name} is deprecated: use {module}.{renamed[name]}", DeprecationWarning, stacklevel=2)
            return namespace[renamed[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["renamed_attributes"]
