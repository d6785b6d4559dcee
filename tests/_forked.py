"""A Python entry point (`main(argv)`) run in a process forked from the test process, as a stand-in for a fresh
`python script.py ...`: a real process (its own pid, signals, SIGKILL, exit status, file descriptors 1 and 2)
that inherits the modules already imported here, so it skips the interpreter start-up and the torch /
transformers / ludic_fast imports (3-10 s of CPU each on a 2-core machine). The child starts as a fresh
interpreter would: SIGINT raising KeyboardInterrupt and SIGTERM ending the process, no logging handler, its
output on the given files; an exception that escapes prints its traceback and exits 1, SystemExit exits with its
code. `start` returns a handle with Popen's interface as the tests use it; `run` waits, as subprocess.run.
Tests that check what a fresh interpreter does (import-time output, the `python -m` entry) start one instead."""

from __future__ import annotations

import importlib
import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO

PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT
Target = Callable[[], "int | None"]


def _child(target: Target, out_fd: int, err_fd: int, env: dict[str, str], close: list[int]) -> None:
    """In the forked process: never returns."""
    code = 1
    try:
        for fd in close:
            os.close(fd)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        sys.stdin = open(os.devnull)  # noqa: SIM115
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logging.root.handlers.clear()  # pytest's capture handlers: the child's logging.basicConfig sets its own
        logging.root.setLevel(logging.WARNING)
        try:
            result = target()
        except SystemExit as exc:
            result = exc.code
        if result is None:
            code = 0
        elif isinstance(result, int):
            code = result
        else:
            print(result, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter's top level: print it, exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - nothing left to report it on
                pass
        os._exit(code)


class Forked:
    """The forked process: pid, poll(), wait(timeout), send_signal(), kill(), returncode (-N after signal N),
    stdout / stderr (text streams when started with PIPE), communicate(timeout)."""

    def __init__(self, pid: int, stdout: IO[str] | None, stderr: IO[str] | None):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read the piped streams to their end while waiting for the exit (as Popen.communicate)."""
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=name, s=stream: got.__setitem__(n, s.read()), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
        for r in readers:
            r.start()
        self.wait(timeout)
        for r in readers:
            r.join(timeout)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return got.get("out"), got.get("err")


def start(target: Target, *, stdout: int | Path | None = None, stderr: int | Path | None = None,
          env: dict[str, str] | None = None) -> Forked:
    """Fork; the child runs `target()` (its value the exit status) with `env` added to its environment.
    stdout / stderr: PIPE, a file path (written), None (this process's), stderr=STDOUT (with stdout)."""
    close_in_child, close_here = [], []
    readers: dict[str, IO[str]] = {}
    fds = {}
    for name, spec in (("out", stdout), ("err", stderr)):
        if spec == STDOUT and name == "err":
            fds[name] = fds["out"]
        elif spec == PIPE:
            r, w = os.pipe()
            readers[name] = os.fdopen(r, "r")
            fds[name], close_in_child = w, [*close_in_child, r]
            close_here.append(w)
        elif spec is None:
            fds[name] = 1 if name == "out" else 2
        else:
            fds[name] = os.open(spec, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            close_here.append(fds[name])
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(target, fds["out"], fds["err"], dict(env or {}), close_in_child)
    for fd in close_here:
        os.close(fd)
    return Forked(pid, readers.get("out"), readers.get("err"))


def run(target: Target, *, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`start` with both streams piped, then wait: (returncode, stdout, stderr) as subprocess.run gives them."""
    proc = start(target, stdout=PIPE, stderr=PIPE, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(["forked", str(proc.pid)], proc.returncode, out, err)


def preload(*names: str) -> None:
    """Import the modules `names` (those whose package is installed) in this process, so that the forked children
    inherit them instead of each importing them when it runs."""
    for name in names:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            importlib.import_module(name)


def script_main(path: Path, imports: tuple[str, ...] = ()) -> Callable[[list[str]], int]:
    """`main` of the script at `path`, imported here under its file's stem with its folder on sys.path while it
    loads (so that it finds its sibling modules, as `python path` does); already imported: the same module.
    `imports`: the modules `main` imports when it runs, preloaded here."""
    preload(*imports)
    name = path.stem
    module = sys.modules.get(name)
    if module is None or Path(getattr(module, "__file__", "")).resolve() != path.resolve():
        sys.path.insert(0, str(path.parent))
        try:
            sys.modules.pop(name, None)
            module = importlib.import_module(name)
        finally:
            sys.path.remove(str(path.parent))
    return module.main
