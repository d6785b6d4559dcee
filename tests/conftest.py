"""Suite-wide switch LUDIC_FAST_PRETEND_CUDA=1 (`make test-pretend-cuda`): run the CPU tests in a process
that claims one CUDA device (tests/pretend_cuda/_pretend_cuda.py), so a device default that leaks into a
CPU test fails here as it would switch device on a GPU machine. The `gpu` tests really need CUDA and are
deselected in that mode."""

import os
import sys
from pathlib import Path

import pytest

PRETEND_DIR = str(Path(__file__).resolve().parent / "pretend_cuda")
if PRETEND_DIR not in sys.path:
    sys.path.insert(0, PRETEND_DIR)

import _pretend_cuda  # noqa: E402

# torch's intra-op threads: the cores shared out among the pytest-xdist workers (one each when make test runs
# two workers on 2 cores), unless OMP_NUM_THREADS is set; child processes inherit the variable. torch's default
# is one thread per core in each worker: the cores are then oversubscribed and every small op waits for a
# descheduled thread (test_preference.py::test_reference_twin_gradcheck_float64 at load 5: 88 s with two
# threads, 6 s with one).
_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))))
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if _pretend_cuda.active():
    if not getattr(torch.cuda.is_available, "pretend_cuda", False) and torch.cuda.is_available():
        raise pytest.UsageError(f"{_pretend_cuda.ENV}=1 is for a machine without CUDA; this one has a GPU")
    _pretend_cuda.install()
    # child Python processes (CLI runs, spawned ranks) import tests/pretend_cuda/sitecustomize.py
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PRETEND_DIR, os.environ.get("PYTHONPATH")) if p)


def pytest_report_header(config):
    if _pretend_cuda.active():
        return f"{_pretend_cuda.ENV}=1: torch reports one CUDA device on a CPU-only build; gpu tests deselected"
    return None


def pytest_collection_modifyitems(config, items):
    if not _pretend_cuda.active():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture
def redis_server(tmp_path):
    """A started redis-server (tests/_redis.py) on a free loopback port, SIGKILLed after the test."""
    from _redis import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
