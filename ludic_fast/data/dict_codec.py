"""Data classes to plain JSON-compatible dicts and back: one generic pair for every type of `data.types`.

`to_dict` writes every field (`dataclasses.fields`) under its name: a nested `DictCodec` as its own dict,
lists and tuples as lists and dicts key by key (element by element, recursively), anything else as it is
(str, int, float, bool, None; free-form fields such as `meta` must themselves be JSON-compatible).
`from_dict` reads the declared field types (`typing.get_type_hints`) to rebuild nested classes (`T`,
`T | None`, `list[T]`) and hands every value to the constructor, whose validation runs as for any caller:
a key that names no field, or a value that is not a dict where a class is expected, is a TypeError naming the
class. Nothing is pickled: the dicts travel as JSON or msgpack.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

_Codec = TypeVar("_Codec", bound="DictCodec")  # typing.Self is Python 3.11+; the package supports 3.10


class DictCodec:
    """Mixin of a dataclass: `to_dict()` / `from_dict(data)`, exact inverses for JSON-compatible field values."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[_Codec], data: Mapping[str, Any]) -> _Codec:
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}.from_dict needs a dict, got {type(data).__name__}")
        hints = _field_types(cls)
        unknown = sorted(set(data) - hints.keys())
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {unknown[0]!r} (its fields: {sorted(hints)})")
        return cls(**{name: _rebuild(hints[name], value) for name, value in data.items()})


def _plain(value: Any) -> Any:
    if isinstance(value, DictCodec):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The declared type of each constructor field of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _rebuild(hint: Any, value: Any) -> Any:
    """`value` read as the declared type `hint`: nested DictCodec classes rebuilt, everything else as it is."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _rebuild(inner[0], value) if len(inner) == 1 else value
    if origin is list and isinstance(value, list):
        return [_rebuild(typing.get_args(hint)[0], v) for v in value]
    if isinstance(hint, type) and issubclass(hint, DictCodec):
        return hint.from_dict(value)
    return value


__all__ = ["DictCodec"]
