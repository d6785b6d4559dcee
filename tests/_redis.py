"""A real redis-server for the pipeline tests: `RedisServer` (a free loopback port, fsync-always AOF; `kill()` +
`start()` is a crash and restart that keeps the data), `needs_server` (skip naming the missing binary) and the
`redis_server` fixture (tests/conftest.py) built on them."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
needs_server = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server (apt-get install redis-server)")


class RedisServer:
    """A redis-server on a free loopback port with fsync-always AOF in `workdir`; `kill()` + `start()` is a
    crash and restart that keeps the data."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
