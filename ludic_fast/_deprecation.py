"""Old names kept working: a module's `__getattr__` that returns a renamed attribute under its old name, and an
old module path that is the moved module itself, each with a DeprecationWarning naming the new one."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import ModuleType
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


def moved_module(old: str, new: ModuleType, note: str = "") -> None:
    """Make the module path `old` (its `__name__`, called from its body) the module `new` itself, so names and
    patches through either path are shared; a DeprecationWarning names the new path (and `note`)."""
    warnings.warn(f"{old} is deprecated; import from {new.__name__}{f' ({note})' if note else ''}", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = new


__all__ = ["renamed_attributes", "moved_module"]
