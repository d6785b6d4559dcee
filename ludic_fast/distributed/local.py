"""Run a function on a local process group (one process per rank on this machine): CPU tests and debugging."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world_size: int, backend: str, init_file: str, args: tuple) -> None:
    """Join the group, run `fn`; an exception propagates (spawn reports it). After a clean finish the worker
    leaves with `os._exit(0)`, skipping interpreter teardown: native threads that libraries keep in a worker
    (gloo, DeepSpeed, accelerate) can abort there ("terminate called without an active exception", seen
    about once in five full test runs), which would turn a finished run into a failure."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_group(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    start_method: str = "spawn") -> None:
    """Call `fn(rank, world_size, *args)` in `world_size` new processes joined in one process group
    (rendezvous through a temporary file, so no port is needed). `fn` must be importable (module level);
    an exception in any rank is raised here (`torch.multiprocessing.ProcessRaisedException`).
    start_method: "spawn" (fresh interpreters), or "fork" (children inherit the imported modules: far quicker
    to start; only from a process that has not started CUDA or a process group)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be 'spawn', 'fork' or 'forkserver', got {start_method!r}")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_entry, args=(fn, world_size, backend, init_file, args), nprocs=world_size, join=True,
                           start_method=start_method)
