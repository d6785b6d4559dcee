"""`ludic-fast bench` stopped by a signal: SIGINT (130) or SIGTERM (143) ends it within seconds with one line
and no traceback, the cases measured before it in its tables; a second signal ends it at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_until_first_case(out: Path) -> subprocess.Popen:
    """A long in-process bench run, returned once its tables hold a case."""
    shapes = ",".join(f"{n}x16x1021" for n in range(64, 64 + 40 * 8, 8))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ludic_fast.cli", "bench", "--shapes", shapes, "--workloads", "head",
         "--impls", "reference", "--one-process", "--repeats", "20", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (out / "results.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_bench_and_keeps_its_tables(tmp_path, sig, status):
    proc = _bench_until_first_case(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == status, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ludic-fast bench: stopped by {signal.Signals(sig).name}: ")
    assert "of 40 cases kept in" in lines[0]
    kept = json.loads((tmp_path / "results.json").read_text())
    assert kept["results"] and kept["meta"]["status"].startswith("incomplete: ")


def test_a_second_sigint_ends_at_once():
    """While the first signal's stop is handled (here: caught and followed by a long wait), a second one ends
    the process at once with 130."""
    code = """if True:
        import os, signal, time
        from ludic_fast.benchmark.runner import BenchStopped, stop_on_signals

        with stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            except BenchStopped as stop:
                print("first", stop.name, flush=True)
            time.sleep(30)
            print("never", flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first SIGINT"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "never" not in out and time.monotonic() - start < 10


def test_a_signal_while_the_tables_are_saved_stops_the_run_after_they_are_whole():
    """A SIGTERM that lands while a table is being written (the bench saves after every case) is held until the
    write ends, then stops the run as any other: what was being saved is saved whole and counted."""
    from ludic_fast.benchmark.runner import BenchStopped, signals_held, stop_on_signals

    written, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(BenchStopped) as stopped, stop_on_signals():
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            written.append("the rest of the table")
        written.append("after the save")  # never reached: the held signal stops the run here
    assert written == ["the rest of the table"] and stopped.value.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before
