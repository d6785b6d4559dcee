"""Count the places where host code reads a tensor's value: on CUDA each is a host-device synchronisation (the
host waits until the device has computed the value), which stalls the queue of kernels a training step keeps
ahead of the device. On a CPU they cost nothing, so this counter makes them visible there.

`HostReads()` (a context manager) records, with the innermost caller outside torch:

- `scalar`: `item()`, `float()`, `int()`, `bool()` (an `if` on a tensor), indexing a sequence with a 0-d tensor
  — every read of one element (aten `_local_scalar_dense`);
- `data-dependent shape`: `nonzero`, `masked_select`, indexing with a boolean mask (the output size is a value
  the host must read);
- `to host`: `tolist()` and `numpy()` of a tensor, `cpu()` and `.to("cpu")` of a tensor not on the CPU.

On a CPU run, reads of tensors built on the host (collation) are counted too: the count is that of the code,
whichever device its tensors sit on. Not counted: the optimizers' own reads of their step counters
(`torch.optim`), host tensors on every device unless `capturable` or `fused`. On CUDA,
`torch.cuda.set_sync_debug_mode("warn")` names the real synchronisations (`bench/trainer_profile.py` uses both).
`HostReads` works through torch function and dispatch modes, under which torch.compile does not compile: a
compiled function that meets a new input inside it runs eagerly there and (torch 2.13) compiles no new graph
afterwards.
"""

from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim")
_THIS = os.path.abspath(__file__)
_TO_HOST = {"tolist", "numpy"}


@dataclass(frozen=True)
class HostRead:
    """One read: its kind (module docstring) and where: `path:line (function)` of the innermost frame outside
    torch and this module."""

    kind: str
    where: str


def _caller() -> str | None:
    """The innermost frame outside torch and this module (None: a read made by torch.optim, not counted)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_OPTIM_DIR):
            return None
        if path != _THIS and not path.startswith(_TORCH_DIR) and "/contextlib.py" not in path:
            return f"{_short(path)}:{frame.lineno} ({frame.name})"
    return "?"


def _short(path: str) -> str:
    for root in ("ludic_fast", "bench", "tests", "site-packages"):
        marker = f"{os.sep}{root}{os.sep}"
        if marker in path:
            return root + os.sep + path.rsplit(marker, 1)[1] if root != "site-packages" else path.rsplit(marker, 1)[1]
    return os.path.basename(path)


class _Functions(TorchFunctionMode):
    def __init__(self, log: list[HostRead]):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _TO_HOST or (name in ("to", "cpu") and _to_cpu(name, args, kwargs)):
            _record(self.log, "to host")
        return func(*args, **kwargs)


def _record(log: list[HostRead], kind: str) -> None:
    where = _caller()
    if where is not None:
        log.append(HostRead(kind, where))


def _to_cpu(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a `cpu()` / `to(...)` call copies a tensor off a device to the host."""
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if name == "cpu":
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


class _Ops(TorchDispatchMode):
    def __init__(self, log: list[HostRead]):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket
        if op is torch.ops.aten._local_scalar_dense:
            _record(self.log, "scalar")
        elif op in (torch.ops.aten.nonzero, torch.ops.aten.masked_select) or (
            op is torch.ops.aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())
            )
        ):
            _record(self.log, "data-dependent shape")
        return func(*args, **kwargs)


class HostReads:
    """`with HostReads() as reads:` ... then `reads.log` (a list of `HostRead`), `len(reads)`."""

    def __init__(self) -> None:
        self.log: list[HostRead] = []
        self._modes = (_Functions(self.log), _Ops(self.log))

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.log)

    def where(self) -> dict[str, int]:
        """{`kind @ where`: count}, in the order first seen."""
        out: dict[str, int] = {}
        for r in self.log:
            key = f"{r.kind} @ {r.where}"
            out[key] = out.get(key, 0) + 1
        return out


class CudaSyncs:
    """`with CudaSyncs() as syncs:` records every synchronising CUDA call that torch reports under
    `torch.cuda.set_sync_debug_mode("warn")` as a `HostRead("cuda sync", where)` in `syncs.log` (the mode and
    the warning filters are restored on exit). Calls made in autograd's device threads (the backward) are
    reported where the backward was called."""

    def __init__(self) -> None:
        self.log: list[HostRead] = []

    def __enter__(self) -> CudaSyncs:
        self._mode = torch.cuda.get_sync_debug_mode()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                self.log.append(HostRead("cuda sync", _caller() or "torch.optim"))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.log)

    where = HostReads.where


__all__ = ["CudaSyncs", "HostRead", "HostReads"]
