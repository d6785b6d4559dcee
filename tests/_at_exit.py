"""The folder removals code registers with `atexit` during a test, recorded instead of registered."""

from __future__ import annotations

import atexit
import shutil


def rmtree_at_exit(monkeypatch) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of every `atexit.register(shutil.rmtree, ...)` from now on; other registrations (other
    libraries register their own) go through."""
    calls: list[tuple[tuple, dict]] = []
    register = atexit.register

    def record(fn, *a, **k):
        if fn is shutil.rmtree:
            calls.append((a, k))
            return fn
        return register(fn, *a, **k)

    monkeypatch.setattr(atexit, "register", record)
    return calls
