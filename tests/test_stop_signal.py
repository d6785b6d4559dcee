"""SIGINT / SIGTERM to `ludic-fast train` (in a process forked from the test's, tests/_forked.py; a fresh
`python -m ludic_fast.cli train` stopped by SIGTERM is test_empty_batches.py's): the first finishes the current
step, writes a checkpoint of it, summary.json and the curves, prints one line saying what was saved and how to
resume, and exits 130 / 143 without a traceback, in the RL phase (asyncio loop), the SFT phase and an offline
preset; a second SIGINT ends the run at once; and (in process) the caller's own handlers are back once the stop
context closes."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import _forked as forked
import pytest

from ludic_fast.cli import main as cli_main

# what a run imports only when it stops (the curves, save_pretrained's unwrap through accelerate): preloaded
# here, once, rather than in each forked run
LATE_IMPORTS = ("matplotlib.pyplot", "deepspeed")
FAST = ["--logger", "print", "--threads", "1", "--device", "cpu", "--checkpoint-every", "1000"]
RL = ["--prompts-per-batch", "4", "--group-size", "4", "--eval-every", "0"]


def _start(out: Path, *flags: str) -> forked.Forked:
    argv = ["train", *FAST, "--output-dir", str(out), *flags]
    forked.preload(*LATE_IMPORTS)
    return forked.start(lambda: cli_main(argv), stdout=forked.PIPE, stderr=forked.PIPE)


def _wait_for_step(proc: forked.Forked, marker: str) -> None:
    """Read stdout until a step record of the phase `marker` (e.g. "[rl] step=") is printed."""
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if marker in line:
            return
        assert time.monotonic() < deadline, "no training step within the deadline"
    raise AssertionError(f"the run ended before a {marker!r} line: {proc.stderr.read()[-2000:]}")


def _finish(proc: forked.Forked) -> tuple[int, str, float]:
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize(
    ("phase", "sig", "flags"),
    [
        ("rl", signal.SIGINT, [*RL, "--sft-steps", "1", "--rl-steps", "500"]),
        ("sft", signal.SIGTERM, [*RL, "--sft-steps", "500", "--rl-steps", "2"]),
        ("dpo", signal.SIGINT, ["--preset", "dpo", "--offline-steps", "500", "--pref-batch-size", "4"]),
    ],
)
def test_first_signal_stops_after_the_step_with_checkpoint_and_summary(tmp_path, phase, sig, flags):
    proc = _start(tmp_path, *flags)
    _wait_for_step(proc, f"[{phase}] step=" if phase != "dpo" else "step=")
    proc.send_signal(sig)
    code, err, seconds = _finish(proc)
    assert code == 128 + sig, err[-2000:]
    assert "Traceback" not in err and seconds < 60
    summary = json.loads((tmp_path / "summary.json").read_text())
    latest = json.loads((tmp_path / phase / "latest.json").read_text())
    metrics = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r["step"] for r in metrics if r.get("phase") == phase][-1]
    assert latest["step"] == last < 500  # the checkpoint is the last logged step's
    assert summary is not None and (phase != "rl" or len(summary["reward_curve"]) == last)
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"stopped by {signal.Signals(sig).name} after {phase} step {last}: saved metrics.jsonl")
    assert "resume: the same `ludic-fast train` command with --resume" in line


def test_second_sigint_ends_at_once_without_traceback(tmp_path):
    proc = _start(tmp_path, *RL, "--sft-steps", "1", "--rl-steps", "500")
    _wait_for_step(proc, "[rl] step=")
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:  # wait for the acknowledgement of the first
        if "SIGINT: finishing the current step" in line:
            break
    proc.send_signal(signal.SIGINT)  # signals sent back to back would reach Python as one
    code, err, _ = _finish(proc)
    assert code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "SIGINT again: stopping at once"
    assert "stopped by SIGINT" not in err  # it did not get to finish the step and write the summary


def test_the_callers_handlers_are_back_after_the_stop_context():
    """In process (a notebook, a caller's program): while the context is open a signal is the run's stop
    request; after it closes, SIGINT and SIGTERM reach the handlers the caller had, so the first Ctrl-C after a
    run is the caller's (not swallowed as a second request that ends the process)."""
    from ludic_fast.engine.stop import STOP_SIGNALS, StopOnSignal

    seen = []

    def callers(signum, frame):
        seen.append(signum)

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, callers)
        with StopOnSignal() as stop:
            assert all(signal.getsignal(sig) is not callers for sig in STOP_SIGNALS)
            signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.exit_code == 143 and seen == []
        assert [signal.getsignal(sig) for sig in STOP_SIGNALS] == [callers, callers]
        signal.raise_signal(signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
