"""One small registry type for every extension point (presets, rollout samplers, reward functions, environments).

An entry is a record with a `name` and a one-line `help`; the registry holds them in the order they were added.
`resolve(spec)` returns a registered entry by name, or loads a third party's by module path `"module:attr"`
(imported on demand, then turned into an entry by the registry's `coerce`, e.g. a plain reward function into a
reward record), so a user adds one without editing the library:

    SAMPLERS.resolve("hf")                       # a registered entry
    SAMPLERS.resolve("my_pkg.sampling:MINE")     # my_pkg.sampling.MINE, a SamplerEntry (or what coerce accepts)

The command line's choices, its `--help`, the flag-scope check and the docs' tables are all read from the
registries, so a name is written once, in its record.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar


class Entry(Protocol):
    """What every registry entry has: its name (what the command line and a config file spell) and one line of help."""

    name: str
    help: str


E = TypeVar("E", bound=Entry)


def load_attr(spec: str, what: str) -> Any:
    """The object `attr` of module `module` for `spec = "module:attr"` (`attr` may be dotted); ValueError naming
    `what` and the spec when it does not have that form, the module does not import or lacks the attribute."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {spec!r}: expected a registered name or 'module:attr'")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {module!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[E]):
    """Named entries of one kind (`kind` names it in errors: "preset", "sampler", "reward", ...).

    coerce(obj, spec) -> entry: turns what a `"module:attr"` spec names into an entry (default: it must already
    be an entry of this registry's type, i.e. have `name` and `help`); it raises TypeError for anything else.
    """

    def __init__(self, kind: str, coerce: Callable[[Any, str], E] | None = None):
        self.kind = kind
        self._coerce = coerce
        self._entries: dict[str, E] = {}

    def add(self, entry: E) -> E:
        """Register `entry` under `entry.name` (ValueError when the name is taken or empty); returns the entry."""
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} entry needs a non-empty str name, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> E:
        """The entry registered as `name`; ValueError listing the registered names otherwise."""
        if name not in self._entries:
            raise ValueError(f"{self.kind} must be one of {', '.join(self._entries)} or 'module:attr', got {name!r}")
        return self._entries[name]

    def resolve(self, spec: str) -> E:
        """A registered entry by name, else the entry a `"module:attr"` spec names (through `coerce`)."""
        if spec in self._entries or ":" not in spec:
            return self.get(spec)
        obj = load_attr(spec, self.kind)
        if self._coerce is not None:
            return self._coerce(obj, spec)
        if not isinstance(getattr(obj, "name", None), str) or not isinstance(getattr(obj, "help", None), str):
            raise TypeError(f"{self.kind} {spec!r}: expected a {self.kind} entry (with name and help), "
                            f"got {type(obj).__name__}")
        return obj

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self) -> Iterator[E]:
        return iter(tuple(self._entries.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, name: str) -> E:
        return self.get(name)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


__all__ = ["Entry", "Registry", "load_attr"]
