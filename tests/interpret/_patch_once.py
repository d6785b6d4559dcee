"""The Triton interpreter with triton.language patched once per kernel launch, not once per device-function call.

The interpreter (triton 3.6 to 3.9) swaps triton.language's builtins for numpy ones when a launch starts
(`interpreter._patch_lang`, undone when the launch ends), and again at every call of a @triton.jit helper inside
the kernel (`tl.zeros`, `tl.sum`, our `_logit_math` functions: thousands per launch), where the modules are
already patched and the walk over their members (`inspect.getmembers`) changes nothing: it was half the
interpreter's time. Here a helper's call skips that walk when every language module in its globals (`tl`,
`tl.core`) has been patched earlier in the same launch; the first helper that needs one not yet patched still
patches it. What the kernels compute is unchanged: tests/interpret/test_patch_once.py compares launches with
and without this, bit for bit."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()  # .patched: ids of the modules patched in the running launch (None outside one)


def _modules(fn) -> frozenset[int]:
    """ids of the language modules in `fn`'s globals, the ones `interpreter._patch_lang` patches for it."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` and its launch (`GridExecutor.__call__`); False, changing nothing,
    where this triton's interpreter lacks either."""
    from triton.runtime import interpreter

    patch_lang, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or launch is None or getattr(patch_lang, "_patch_once", False):
        return False
    run_launch = launch.__call__

    def patch_lang_once(fn):
        patched, mods = getattr(_state, "patched", None), _modules(fn)
        if patched is not None and mods <= patched and not getattr(_state, "off", False):
            return _NothingToRestore()
        scope = patch_lang(fn)
        if getattr(_state, "starting", False):  # the launch's own patch (undone when it ends)
            _state.starting, _state.patched = False, mods
        elif patched is not None:
            _state.patched = patched | mods
        return scope

    def launch_once(self, *args, **kwargs):
        _state.starting, _state.patched = True, None
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            _state.starting, _state.patched = False, None

    patch_lang_once._patch_once = True
    interpreter._patch_lang = patch_lang_once
    launch.__call__ = launch_once
    return True


@contextlib.contextmanager
def patching_every_call() -> Iterator[None]:
    """The interpreter's own behaviour (a patch at every helper call) inside the block."""
    _state.off = True
    try:
        yield
    finally:
        _state.off = False
