"""Host-side tensor descriptors for the tl.dot kernels' TMA loads (Hopper's tensor memory accelerator, sm_90+).

A descriptor names a 2-D view [rows, cols] and the block a load fetches; TMA copies the block into shared
memory and fills what lies outside [rows, cols] with zeros, so ragged tiles need no masks. TMA needs a
16-byte aligned base, a 16-byte aligned row stride and unit column stride; `tma_ready` checks that, and
callers use pointer loads where it fails. `triton.tools.tensor_descriptor.TensorDescriptor` is the API that
triton 3.6 and 3.9 share (their interpreters run it too); unlike the in-kernel `tl.make_tensor_descriptor` it
needs no `triton.set_allocator`.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

#: TMA's alignment of the base address and of every stride but the last, in bytes
ALIGN = 16


def tma_ready(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a non-empty 2-D view that a TMA descriptor can cover."""
    for t in tensors:
        size = t.element_size()
        if t.dim() != 2 or 0 in t.shape or t.stride(1) != 1:
            return False
        if t.data_ptr() % ALIGN or (t.stride(0) * size) % ALIGN:
            return False
    return True


def descriptor(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    """The descriptor of the 2-D view `t` (see `tma_ready`) with `block`-shaped loads (zero-filled outside)."""
    if not tma_ready(t):
        raise ValueError(
            f"tensor of shape {tuple(t.shape)} and strides {t.stride()} is not TMA-aligned "
            f"(unit column stride, {ALIGN}-byte aligned base and row stride)"
        )
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))
