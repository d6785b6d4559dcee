"""Triton launches a kernel on the current CUDA device, whatever device its tensors are on: every launcher runs
its launch under `on_device_of(tensor)`, so inputs on cuda:1 work while cuda:0 is current."""

from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The CUDA device context of `t` (a no-op for CPU tensors, which the interpreter runs)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
