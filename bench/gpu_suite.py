"""The GPU suite in groups, every test under a time limit: a failing test is one line of the verdict, a hanging
one costs its limit and nothing else.

    python bench/gpu_suite.py --out bench/results/gpu --seconds 300 --test-seconds 90

Groups, in this order: `core` (every gpu- or interpret-marked test of the GPU suite but the experimental ones),
`experimental` (the opt-in TMA variants: "tma" in the test's name or id; run last). Each group is one pytest
process that loads this file as a plugin: it records each test's start and outcome in OUT/suite-outcomes.jsonl
as it happens and arms `faulthandler.dump_traceback_later(test_seconds, exit=True)` at the start of each test
(a test still running at its limit, in Python or inside a CUDA call, gets every thread's stack in the log and
ends the process). The group then restarts with the tests it already ran, and the one that hung, deselected.
All groups together stop `--seconds` after the start; what did not run is counted as such.
Writes OUT/suite-NAME.log (every pytest line) and OUT/suite-NAME-verdict.md (NAME: the groups run, or 'all');
exits 0 when no test failed or hung.
`--tests` replaces the test paths (the rehearsal's injected tests use it through env GPU_SUITE_TESTS).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = ["tests/gpu", "tests/interpret", "tests/test_losses_triton.py", "tests/test_autocast.py"]
#: (group, whether it holds the TMA tests: "tma" in the test's name or parameter id). Not `pytest -k tma`:
#: pytest 9.1's -k also matches a function's attribute names, and every marked test has "pytestmark"
GROUPS = (("core", False), ("experimental", True))
OUTCOMES_ENV, DONE_ENV, LIMIT_ENV = "GPU_SUITE_OUTCOMES", "GPU_SUITE_DONE", "GPU_SUITE_TEST_SECONDS"
TMA_ENV = "GPU_SUITE_TMA"
#: the stacks of a hung test go to the process's stderr as it was before pytest captured it
_STDERR = os.fdopen(os.dup(2), "w") if os.environ.get(LIMIT_ENV) else None


# ------------------------------------------------------------------------------ the plugin (in each pytest)
def _record(**row) -> None:
    with open(os.environ[OUTCOMES_ENV], "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_collection_modifyitems(session, config, items):
    done = set(Path(os.environ[DONE_ENV]).read_text().split("\n")) if os.environ.get(DONE_ENV) else set()
    tma = os.environ.get(TMA_ENV)
    kept = [item for item in items
            if item.nodeid not in done and (tma is None or ("tma" in item.name.lower()) == (tma == "1"))]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def pytest_collection_finish(session):
    _record(collected=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    _record(start=nodeid)
    faulthandler.dump_traceback_later(float(os.environ[LIMIT_ENV]), exit=True, file=_STDERR)


def pytest_runtest_logreport(report):
    if report.failed or report.skipped or report.when == "call":
        _record(test=report.nodeid, when=report.when, outcome=report.outcome)


def pytest_runtest_logfinish(nodeid, location):
    faulthandler.cancel_dump_traceback_later()
    _record(finish=nodeid)


# ------------------------------------------------------------------------------------------- the driver
def _outcomes(path: Path) -> tuple[list[str], dict[str, str], list[str]]:
    """(collected node ids, final outcome per finished test, tests started and never finished)."""
    collected, outcome, started, finished = [], {}, [], set()
    for line in path.read_text().splitlines() if path.exists() else ():
        row = json.loads(line)
        if "collected" in row:
            collected += [n for n in row["collected"] if n not in collected]
        elif "start" in row:
            started.append(row["start"])
        elif "finish" in row:
            finished.add(row["finish"])
        elif outcome.get(row["test"]) != "failed":
            outcome[row["test"]] = row["outcome"]
    return collected, {n: outcome.get(n, "passed") for n in finished}, [n for n in started if n not in finished]


def run_group(name: str, tma: bool, tests: list[str], out: Path, test_seconds: float, deadline: float,
              log) -> dict:
    """Run one group to its end (restarting after each hang) or to the deadline; its verdict row."""
    outcomes, done = out / f"suite-{name}.jsonl", out / f"suite-{name}.done"
    outcomes.unlink(missing_ok=True)
    done.write_text("")
    env = {**os.environ, OUTCOMES_ENV: str(outcomes), DONE_ENV: str(done), LIMIT_ENV: str(test_seconds),
           TMA_ENV: str(int(tma)),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-p", "gpu_suite", "-p", "no:cacheprovider", "-c", "pyproject.toml",
           "--rootdir", ".", "-v", "-rfs", "-m", "gpu or interpret", *tests]
    cut, known_hung = False, []
    while True:
        left = deadline - time.monotonic()
        if left <= 1:
            cut = True
            break
        log(f"$ {' '.join(cmd)}   # group {name}, {left:.0f}s left, {test_seconds:g}s per test\n")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                log(line)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc, cut = None, True
        _, finished, started = _outcomes(outcomes)
        new = [n for n in started if n not in known_hung]
        if rc is None or not new:  # cut by the deadline, or the group ran to its end
            break
        known_hung += new
        log(f"[gpu_suite] {new[-1]} hung: over its {test_seconds:g}s, the process ended; restarting group {name}\n")
        done.write_text("\n".join([*finished, *known_hung]))
    collected, finished, _ = _outcomes(outcomes)
    hung = known_hung  # a test still running when the deadline came is counted as not run
    counts = {k: sum(1 for v in finished.values() if v == k) for k in ("passed", "failed", "skipped")}
    not_run = [n for n in collected if n not in finished and n not in hung]
    return {"group": name, **counts, "hung": hung, "not_run": len(not_run), "cut": cut,
            "failed_tests": [n for n, v in finished.items() if v == "failed"]}


def verdict_markdown(rows: list[dict], test_seconds: float) -> str:
    ok = all(not r["failed"] and not r["hung"] and not r["not_run"] for r in rows)
    ran = sum(r["passed"] + r["failed"] + len(r["hung"]) for r in rows)
    verdict = "NOT green" if not ok else "green" if ran else "no test ran (every one skipped: see the reasons)"
    lines = [f"# GPU suite verdict: {verdict}", "",
             f"Every test under a {test_seconds:g} s limit; groups in the order run.", "",
             "| group | passed | failed | skipped | hung | not run |", "|---|---|---|---|---|---|"]
    for r in rows:
        not_run = f"{r['not_run']}{' (time up)' if r['cut'] else ''}"
        lines.append(f"| {r['group']} | {r['passed']} | {r['failed']} | {r['skipped']} | {len(r['hung'])} | "
                     f"{not_run} |")
    for r in rows:
        lines += [f"- failed ({r['group']}): `{n}`" for n in r["failed_tests"]]
        lines += [f"- hung ({r['group']}, over {test_seconds:g} s): `{n}`" for n in r["hung"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder of the log and the verdict")
    p.add_argument("--seconds", type=float, default=300.0, help="all groups stop this long after the start")
    p.add_argument("--test-seconds", type=float, default=90.0, help="each test's limit")
    p.add_argument("--tests", nargs="+", default=None, help="test paths (default: the GPU suite's)")
    p.add_argument("--group", action="append", choices=[g for g, _ in GROUPS],
                   help="run only this group (repeatable; default: all, in order)")
    args = p.parse_args(argv)
    for name, value in (("--seconds", args.seconds), ("--test-seconds", args.test_seconds)):
        if not value > 0:
            p.error(f"{name} must be > 0, got {value}")
    tests = args.tests or os.environ.get("GPU_SUITE_TESTS", "").split() or TESTS
    deadline = time.monotonic() + args.seconds
    args.out.mkdir(parents=True, exist_ok=True)
    groups = [(g, t) for g, t in GROUPS if args.group is None or g in args.group]
    name = "-".join(g for g, _ in groups) if args.group else "all"
    with open(args.out / f"suite-{name}.log", "w") as log_file:

        def log(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
            log_file.write(text)
            log_file.flush()

        rows = []
        for group, tma in groups:
            rows.append(run_group(group, tma, tests, args.out, args.test_seconds, deadline, log))
            (args.out / f"suite-{name}-verdict.md").write_text(verdict_markdown(rows, args.test_seconds))
    print(verdict_markdown(rows, args.test_seconds))
    return 0 if all(not r["failed"] and not r["hung"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
