"""Test helpers (dispatch-mode recorders, forward and backward, custom Functions included): the largest tensor
any op allocates; the ops that make the host wait for the device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestAllocation(TorchDispatchMode):
    """Largest `numel` among the outputs of every op dispatched, and the op that produced it."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim"}


class HostSyncs(TorchDispatchMode):
    """Names of the dispatched ops that synchronise the host with the device: `.item()`/`bool()`/`int()`
    (`_local_scalar_dense`), data-dependent output sizes (`nonzero`, `masked_select`, `unique`, boolean-mask
    indexing, `repeat_interleave` without `output_size`)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNCING:
            self.ops.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        ):
            self.ops.append(f"{name}[bool]")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            self.ops.append(name)
        return func(*args, **kwargs)
