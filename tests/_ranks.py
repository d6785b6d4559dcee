"""Runs on several ranks as torchrun starts them, forked from the test process, and the comparison of their
parameters with a one-process run (tests/test_cli_parallel.py, tests/test_pipeline_torchrun.py)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(main: Callable[[], int], env: dict[str, str]) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    os._exit(main())


def fork_ranks(main: Callable[[], int], world: int, *, torchrun: bool = True, on_start=None,
               timeout_s: float = 240) -> list[int]:
    """`main()` (its value the exit code) in `world` processes forked from this one (the imports are inherited, so
    a rank costs no interpreter start-up), each with torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT (`torchrun=False`: one process without them); `on_start(procs)` runs once all have started.
    Returns the exit codes in rank order."""
    ctx = multiprocessing.get_context("fork")
    port = str(_free_port())
    procs = []
    for rank in range(world if torchrun else 1):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port} if torchrun else {}
        procs.append(ctx.Process(target=_rank_main, args=(main, env)))
        procs[-1].start()
    if on_start is not None:
        on_start(procs)
    for p in procs:
        p.join(timeout_s)
    return [p.exitcode for p in procs]


def assert_same_params(wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor], *, lr: float, steps: int) -> None:
    """The two runs' parameters agree to fp32 summation order. AdamW's per-element step m / (sqrt(v) + eps) turns
    the reordered sums of a rank's gradient all-reduce into an update difference of up to lr where |g| is near
    eps, so: every element within 10% of lr x steps, and 99.9% of them within 1e-6 + 1e-4 |w| (a wrong share
    of the data moves most elements by ~lr)."""
    assert wa.keys() == wb.keys()
    diffs = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    scale = torch.cat([wb[k].abs().flatten() for k in wa])
    assert float(diffs.max()) <= 0.1 * lr * steps, float(diffs.max())
    close = float((diffs <= 1e-6 + 1e-4 * scale).float().mean())
    assert close >= 0.999, close
