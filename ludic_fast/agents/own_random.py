"""An environment's own random state for libraries that draw from the process-wide generators.

Some libraries seed and draw from Python's global `random` (and numpy's global `np.random`) inside their
environments' `reset`/`step`. Episodes run concurrently in threads, so one episode's reset would reseed the
generator another episode is drawing from. `OwnRandomState` keeps one episode's generator states apart: every
`with state:` takes one process-wide lock, installs the episode's saved states in the global generators, runs the
call, saves the states the call left and puts back the ones it found. So each episode draws the same numbers as
the library run alone with the same seed, whatever else runs, and code outside the block sees its own sequence
untouched. Every library call that may touch the global generators must run inside the block of its episode.
"""

from __future__ import annotations

import random
import sys
import threading
from types import TracebackType
from typing import Any

GLOBAL_RANDOM_LOCK = threading.RLock()
"""Held while an episode's states are installed in the global generators (one episode at a time)."""


def _numpy_random() -> Any:
    """numpy.random when numpy is already imported (a library that uses it has imported it), else None."""
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


class OwnRandomState:
    """One episode's states of `random` and numpy's global generator, seeded from `seed` (module docstring)."""

    def __init__(self, seed: int | str):
        saved = random.getstate()
        random.seed(seed)
        self._random = random.getstate()
        random.setstate(saved)
        self._numpy: Any = None
        self._numpy_seed = random.Random(f"numpy:{seed}").getrandbits(32)
        self._outer: list[tuple[Any, Any] | None] = []

    def __enter__(self) -> OwnRandomState:
        GLOBAL_RANDOM_LOCK.acquire()
        if self._outer:  # already installed (a nested block of this state): nothing to swap
            self._outer.append(None)
            return self
        nprand = _numpy_random()
        self._outer.append((random.getstate(), nprand.get_state() if nprand is not None else None))
        random.setstate(self._random)
        if nprand is not None:
            if self._numpy is None:
                self._numpy = nprand.RandomState(self._numpy_seed).get_state()
            nprand.set_state(self._numpy)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            outer = self._outer.pop()
            if outer is None:
                return
            outer_random, outer_numpy = outer
            self._random = random.getstate()
            random.setstate(outer_random)
            nprand = _numpy_random()
            if nprand is not None:
                self._numpy = nprand.get_state()
                if outer_numpy is not None:
                    nprand.set_state(outer_numpy)
        finally:
            GLOBAL_RANDOM_LOCK.release()


__all__ = ["GLOBAL_RANDOM_LOCK", "OwnRandomState"]
