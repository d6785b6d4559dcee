"""Memory budgets and the element rule of the head's chunks.

`parse_memory_budget` turns '4GiB', '512MiB', '3.5GB', '1e9' or an int into bytes. The element rule cuts a call
of N tokens and vocabulary V into chunks of at most `chunk_elements` logit elements (tokens x vocabulary
columns): whole vocabulary rows while at least 16 tokens fit, else 16 tokens and a vocabulary slice. It is the
CPU default (DEFAULT_CHUNK_ELEMENTS elements) and the low-level `chunk_elements` override, which env
LUDIC_FAST_CHUNK_ELEMENTS (read at each call) supplies when a call passes neither it nor a memory budget.
The device cost model and planner that choose chunks under a byte budget live in `ludic_fast.ops.plan`.
"""

from __future__ import annotations

import os
import re

#: CPU default: chunks of this many logit elements (tokens x vocab columns, 256 MiB of fp32), the CPU-tuned rule
DEFAULT_CHUNK_ELEMENTS = 64 * 2**20
#: environment override of the chunk elements when a call passes neither chunk_elements nor memory_budget
CHUNK_ELEMENTS_ENV = "LUDIC_FAST_CHUNK_ELEMENTS"
_MIN_CHUNK_TOKENS = 16  # the sliced-vocabulary fallback keeps at least this many tokens per chunk
_MIN_GRAD_COLS = 1024  # pre-model rule of the workspace backward (chunk_elements override)


def env_chunk_elements() -> int | None:
    """$LUDIC_FAST_CHUNK_ELEMENTS read now (so it can change between calls), or None when unset; a value that
    is not a positive integer raises."""
    raw = os.environ.get(CHUNK_ELEMENTS_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{CHUNK_ELEMENTS_ENV} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{CHUNK_ELEMENTS_ENV} must be a positive integer, got {raw!r}")
    return value


def default_chunk_elements() -> int:
    """The element rule's chunk when a call passes none: $LUDIC_FAST_CHUNK_ELEMENTS or DEFAULT_CHUNK_ELEMENTS."""
    env = env_chunk_elements()
    return DEFAULT_CHUNK_ELEMENTS if env is None else env


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_budget(value: int | str | None, name: str = "memory_budget") -> int | None:
    """Bytes from an int (> 0) or a string such as '4GiB', '512MiB', '3.5GB', '1e9'; None passes through."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int number of bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be bytes like '4GiB', '512MiB', '3.5GB' or an int, got {value!r}")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value}")
    return value


def align_down(x: int, align: int, cap: int) -> int:
    """`x` rounded down to a multiple of `align` (`cap` itself when x >= cap); 0 when below one multiple."""
    return cap if x >= cap else x // align * align


def elements_rule(n: int, v: int, elements: int, align: int = 1) -> tuple[int, int]:
    """(tokens, vocab columns) with tokens x columns <= elements: whole vocabulary rows unless fewer than 16
    (align > 1: `align`) fit, then that many tokens and a vocabulary slice; widths multiples of `align`. With
    align = 1 this is the CPU rule and the `chunk_elements` override."""
    min_rows = min(max(n, 1), _MIN_CHUNK_TOKENS if align == 1 else align)
    if elements // v >= min_rows:
        return max(1, align_down(min(n, elements // v), align, n)), v
    return min_rows, max(min(v, align), align_down(elements // min_rows, align, v))


def chunk_plan(n: int, v: int, chunk_elements: int | None) -> tuple[int, int]:
    """(tokens, vocab columns) of one chunk under the element rule (None: `default_chunk_elements()`)."""
    elements = default_chunk_elements() if chunk_elements is None else int(chunk_elements)
    if elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {elements}")
    return elements_rule(n, v, elements)


def grad_blocks(n: int, v: int, elements: int) -> tuple[int, int]:
    """The workspace backward's blocks under a `chunk_elements` override: all tokens of a vocabulary slice of
    at least 1024 columns when that fits (slices narrower than V: multiples of 128 columns), else 1024-column
    slices of fewer tokens."""
    cols = min(v, elements // max(n, 1))
    if cols >= min(v, _MIN_GRAD_COLS):
        return max(n, 1), cols if cols == v else cols // 128 * 128
    cols = min(v, _MIN_GRAD_COLS)
    return max(1, elements // cols), cols


__all__ = [
    "parse_memory_budget", "default_chunk_elements", "env_chunk_elements", "chunk_plan", "elements_rule",
    "grad_blocks", "DEFAULT_CHUNK_ELEMENTS", "CHUNK_ELEMENTS_ENV",
]
