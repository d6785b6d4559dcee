"""Stop on request: the first SIGINT (Ctrl-C) or SIGTERM (what a scheduler sends) asks the run to stop after
the current optimizer step; a second SIGINT ends the process at once (exit 130, no traceback).

    with StopOnSignal() as stop:
        trainer.train(steps, stop=stop)     # returns after the step during which the signal came
    if stop.requested:
        return stop.exit_code               # 128 + the signal's number: 130 (SIGINT), 143 (SIGTERM)

A batch source that can wait a long time for a usable batch (the Redis pipeline's) checks the request itself and
raises `StopRequested`; so does the RL objective before it refetches after an empty batch (`Engine.stop_signal`,
the running `train` call's stop). `Engine.train` then ends as after a step, without taking one.

The handlers are installed only from the main thread (Python delivers signals there); elsewhere the object
never reports a request. Installing ours before `asyncio.run` keeps asyncio from installing its own SIGINT
handler, so a request no longer waits for the event loop to be cancelled.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

#: the signals that ask for a stop
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(Exception):
    """Raised by a batch source that saw a stop request while the engine waited for a batch (module docstring)."""


class StopOnSignal:
    """Context manager recording the first stop signal (`requested`, `signal_name`, `exit_code`)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return "" if self.signum is None else signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (the shell's convention): 130 for SIGINT, 143 for SIGTERM."""
        if self.signum is None:
            raise ValueError("no stop was requested")
        return 128 + self.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second request: end now (os._exit: no unwinding, no traceback)
            os.write(2, f"\n{name} again: stopping at once\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"\n{name}: finishing the current step, then stopping (Ctrl-C again stops at once)\n".encode())

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


__all__ = ["STOP_SIGNALS", "StopOnSignal", "StopRequested"]
