"""The imports of a test process kept out of the garbage collector's walks, for tests that run benchmark cases
in this process: the runner ends each in-process case with `gc.collect()`, which walks every tracked object;
with torch, transformers and the peers imported here that is ~0.4 M objects, 0.3-0.6 s a case (most of such a
test's time). `gc.freeze()` moves every object alive now to a generation the collector skips; what the cases
make is still collected, and `gc.unfreeze()` hands the rest back at the end."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_imports(peers: bool = True) -> Iterator[None]:
    """A full collection, then the heap frozen; `peers`: the benchmark's peers imported first (as its first
    in-process case would)."""
    if peers:
        from ludic_fast.benchmark.impls import preload

        preload()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
