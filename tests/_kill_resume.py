"""Harness of the kill -9 checkpoint tests. The child script takes `run_dir mode total crash` (mode full |
crash | resume), prints `STEP {json with "step"}` after each step, `WRITING` when the crash run starts writing
the checkpoint of step `crash`, and `FINAL {json with "start"}` at the end (start: the step it resumed from).
Each run is a process forked from the test process (tests/_forked.py), the script run as __main__ with its
imports preloaded here; in crash mode it calls `stall_checkpoint_write(crash)`."""

from __future__ import annotations

import ast
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import _forked as forked


def stall_checkpoint_write(crash_step: int) -> None:
    """In the child: the checkpoint of step `crash_step` writes part of its first safetensors file, prints
    WRITING and stalls there (the parent kills it); other checkpoints are written normally."""
    from ludic_fast.run import checkpoint

    real_save_file = checkpoint.save_file

    def slow_save_file(tensors, path, *a, **k):
        if f"{crash_step:06d}" in str(path):
            with open(path, "wb") as f:
                f.write(b"partial")
                f.flush()
            print("WRITING", flush=True)
            time.sleep(120)
        return real_save_file(tensors, path, *a, **k)

    checkpoint.save_file = slow_save_file


def _as_main(script: Path, *args: str) -> forked.Target:
    """The child's target: `python script args...` in the forked process."""
    def main() -> None:
        sys.argv = [str(script), *args]
        runpy.run_path(str(script), run_name="__main__")

    return main


def _run(script: Path, *args: str) -> list[str]:
    proc = forked.run(_as_main(script, *args), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _preload_imports(source: str) -> None:
    """The modules the child script imports at its top level, imported here once for all its runs."""
    tree = ast.parse(source)
    forked.preload(*[node.module for node in tree.body if isinstance(node, ast.ImportFrom)],
                   *[alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names])


def _parse(lines: list[str]) -> tuple[dict[int, dict], dict]:
    steps, final = {}, {}
    for line in lines:
        if line.startswith("STEP "):
            rec = json.loads(line[5:])
            steps[rec["step"]] = rec
        elif line.startswith("FINAL "):
            final = json.loads(line[6:])
    return steps, final


def kill_mid_write_then_resume(tmp_path: Path, child: str, total: int, crash: int):
    """Run `child` uninterrupted for `total` steps; again, SIGKILLed while writing step `crash`'s checkpoint;
    then resumed. Checks what every such test checks: the killed run logged steps 1..crash-1 as the full run
    did, left only a hidden temp dir, and `latest.json` names step crash-1, from which the resumed run starts
    and runs steps crash..total. Returns (full steps, full final, resumed steps, resumed final)."""
    script = tmp_path / "child.py"
    script.write_text(child)
    _preload_imports(child)
    full_steps, full_final = _parse(_run(script, str(tmp_path / "full"), "full", str(total), "0"))
    assert sorted(full_steps) == list(range(1, total + 1))

    run_dir = tmp_path / "crashed"
    proc = forked.start(_as_main(script, str(run_dir), "crash", str(total), str(crash)), stdout=forked.PIPE,
                        stderr=forked.PIPE)
    crashed_lines = []
    deadline = time.monotonic() + 300
    try:
        for line in proc.stdout:
            crashed_lines.append(line.rstrip("\n"))
            if line.startswith("WRITING"):
                os.kill(proc.pid, signal.SIGKILL)  # kill -9 mid-write
                break
            assert time.monotonic() < deadline, "child never reached the checkpoint write"
    finally:
        proc.kill()
        proc.wait()
    assert any(line.startswith("WRITING") for line in crashed_lines), proc.stderr.read()[-3000:]
    crashed_steps, _ = _parse(crashed_lines)
    assert sorted(crashed_steps) == list(range(1, crash))  # step `crash` trained, then died while checkpointing
    assert [crashed_steps[s] for s in range(1, crash)] == [full_steps[s] for s in range(1, crash)]
    assert list(run_dir.glob(".tmp-step_*"))  # the interrupted write left only a hidden temp dir
    assert json.loads((run_dir / "latest.json").read_text())["step"] == crash - 1

    resumed_steps, resumed_final = _parse(_run(script, str(run_dir), "resume", str(total), "0"))
    assert resumed_final["start"] == crash - 1  # the previous checkpoint loaded
    assert sorted(resumed_steps) == list(range(crash, total + 1))
    return full_steps, full_final, resumed_steps, resumed_final
