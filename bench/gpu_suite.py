"""The GPU suite in groups, every test under a time limit, and a verdict that survives any cut: a failing test
is a section of the verdict with its message and the end of its traceback, a hanging one costs its limit and
nothing else, a cut (the suite's own --seconds, or a SIGTERM from an outer `timeout`) leaves the verdict of
every test that ran and the list of those that did not.

    python bench/gpu_suite.py --out bench/results/gpu --seconds 300 --test-seconds 90
    python bench/gpu_suite.py --out DIR --group core --prior OLD/suite-core.jsonl --drop-duplicates

Groups, in this order: `core` (every gpu- or interpret-marked test of the GPU suite but the experimental ones),
`experimental` (the opt-in TMA variants: "tma" in the test's name or id; run last). Each group is one pytest
process that loads this file as a plugin. The plugin appends to OUT/suite-NAME.jsonl, the moment it happens
(one line per event, the file closed after each): the tests collected, each test's start, each failed or
skipped phase with its message, the last TRACEBACK_LINES lines of its traceback or its skip reason, and each
test's end with its seconds. It arms `faulthandler.dump_traceback_later(test_seconds, exit=True)` at each
test's start (a test still running at its limit, in Python or inside a CUDA call, gets every thread's stack in
the log and ends the process; the group restarts without the tests that ran and the one that hung), and stops
starting tests once fewer than --reserve seconds are left before --seconds. The driver rewrites
OUT/suite-NAME-verdict.md (NAME: the groups run, or 'all') whenever the jsonl grows, at each group's end, at
--seconds (it then ends pytest) and on SIGTERM (it ends pytest, writes the verdict and exits 143); each
`--verdict-copy` folder gets every rewrite too.

`--shards N` runs each group as N pytest processes at once (shard i: every N-th test of the group's order
from the i-th, so each shard starts with its share of the prior failures), each with its own jsonl
(suite-NAME.i.jsonl), its own restarts after a hang and the same deadline; the verdict has a row per shard. A
test spends most of its time compiling kernels and in Python, which a 16-core GPU machine runs side by side.

`--prior JSONL` (a previous run's jsonl, repeatable) orders each group: the tests that failed or hung there
first, then those it never finished (not reached, or not yet written then), then the rest, each part in
collection order. `--drop-duplicates` leaves out the tests of DUPLICATES (each runs exactly the code of a
test that stays, at the same shape; the verdict counts them and says why). Exits 0 when every group ran to
its end with no test failed or hung (skips allowed), else 1. `--tests` replaces the test paths (the
rehearsal's injected tests use it through env GPU_SUITE_TESTS).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

TESTS = ["tests/gpu", "tests/interpret", "tests/test_losses_triton.py", "tests/test_autocast.py"]
#: (group, whether it holds the TMA tests: "tma" in the test's name or parameter id). Not `pytest -k tma`:
#: pytest 9.1's -k also matches a function's attribute names, and every marked test has "pytestmark"
GROUPS = (("core", False), ("experimental", True))
#: (node id pattern, why the time-boxed session leaves it out): each runs the code of a test that stays
DUPLICATES = (
    (r"tests/gpu/test_gpu_head\.py::test_(head_matches_reference|more_than_2_to_the_31_logits)\[cuda-.*auto\]$",
     "strategy 'auto' runs the plan of the strategy it picks, which is also run forced at the same shape "
     "(plan_head(auto) == plan_head(forced), tests/test_gpu_tooling.py)"),
)
ENV = {k: f"GPU_SUITE_{k.upper()}" for k in ("outcomes", "done", "test_seconds", "tma", "deadline", "reserve",
                                              "order", "drop", "shard")}
TRACEBACK_LINES = 25
#: the stacks of a hung test go to the process's stderr as it was before pytest captured it
_STDERR = os.fdopen(os.dup(2), "w") if os.environ.get(ENV["test_seconds"]) else None
_STATE: dict = {}


# ------------------------------------------------------------------------------ the plugin (in each pytest)
def _record(**row) -> None:
    with open(os.environ[ENV["outcomes"]], "a") as f:
        f.write(json.dumps({**row, "t": round(time.time(), 3)}) + "\n")


def _rank(nodeid: str, prior: dict) -> int:
    """0: failed or hung in a prior run; 1: never finished there; 2: finished there."""
    return 0 if nodeid in prior["bad"] else 2 if nodeid in prior["finished"] else 1


def pytest_sessionstart(session):
    _STATE["session"] = session


def pytest_collection_modifyitems(session, config, items):
    done = set(Path(os.environ[ENV["done"]]).read_text().split("\n")) if os.environ.get(ENV["done"]) else set()
    tma = os.environ.get(ENV["tma"])
    drop = [re.compile(p) for p in json.loads(os.environ.get(ENV["drop"], "[]"))]
    kept = [item for item in items if tma is None or ("tma" in item.name.lower()) == (tma == "1")]
    dropped = [item.nodeid for item in kept if any(p.search(item.nodeid) for p in drop)]
    kept = [item for item in kept if item.nodeid not in dropped]
    if os.environ.get(ENV["order"]):
        prior = json.loads(Path(os.environ[ENV["order"]]).read_text())
        prior = {k: set(v) for k, v in prior.items()}
        kept.sort(key=lambda item: _rank(item.nodeid, prior))  # stable: collection order within each rank
    shard, shards = (int(x) for x in os.environ.get(ENV["shard"], "0/1").split("/"))
    kept = [item for item in kept[shard::shards] if item.nodeid not in done]  # the same share after a restart
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
    if dropped and shard == 0:  # one shard reports the group's left-out tests
        _record(dropped=dropped)


def pytest_collection_finish(session):
    _record(collected=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    _STATE["start"] = time.monotonic()
    _record(start=nodeid)
    faulthandler.dump_traceback_later(float(os.environ[ENV["test_seconds"]]), exit=True, file=_STDERR)


def _failure(report) -> dict:
    """The failure's one-line message and the last lines of its traceback."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = report.longreprtext.rstrip().splitlines()
    message = crash.message if crash is not None else (text[-1] if text else "")
    return {"message": message, "traceback": text[-TRACEBACK_LINES:]}


def pytest_runtest_logreport(report):
    if not (report.failed or report.skipped or report.when == "call"):
        return
    row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.failed:
        row.update(_failure(report))
    elif report.skipped and isinstance(report.longrepr, tuple):
        row["reason"] = str(report.longrepr[2])
    _record(**row)


def pytest_runtest_logfinish(nodeid, location):
    faulthandler.cancel_dump_traceback_later()
    _record(finish=nodeid, seconds=round(time.monotonic() - _STATE.get("start", time.monotonic()), 3))
    left = float(os.environ.get(ENV["deadline"], "inf")) - time.time()
    session = _STATE.get("session")
    if left < float(os.environ.get(ENV["reserve"], "0")) and session is not None and not session.shouldstop:
        session.shouldstop = f"gpu_suite: {left:.0f} s left of the suite's time, no further test started"
        _record(stopped=session.shouldstop)


# ------------------------------------------------------------------------------------------- the driver
def read_group(path: Path) -> dict:
    """A group's jsonl as {collected, dropped, outcome (finished tests), failures, skips, seconds, running,
    stopped}: a test's outcome is 'failed' if any phase failed."""
    g = {"collected": [], "dropped": [], "outcome": {}, "failures": {}, "skips": {}, "seconds": {},
         "started": [], "stopped": None}
    phases: dict[str, str] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut mid-write by a kill
            continue
        if "collected" in row:
            g["collected"] += [n for n in row["collected"] if n not in g["collected"]]
        elif "dropped" in row:  # recorded again by each restart of the group
            g["dropped"] += [n for n in row["dropped"] if n not in g["dropped"]]
        elif "start" in row:
            g["started"].append(row["start"])
        elif "stopped" in row:
            g["stopped"] = row["stopped"]
        elif "finish" in row:
            n = row["finish"]
            g["outcome"][n] = phases.get(n, "passed")
            g["seconds"][n] = row.get("seconds")
        else:
            n = row["test"]
            if phases.get(n) != "failed":
                phases[n] = row["outcome"]
            if row["outcome"] == "failed":
                g["failures"].setdefault(n, []).append(row)
            elif row["outcome"] == "skipped":
                g["skips"][n] = row.get("reason", "")
    g["running"] = [n for n in g["started"] if n not in g["outcome"]]
    return g


def prior_order(paths: list[Path]) -> dict[str, list[str]]:
    """{'bad': failed or hung in any prior jsonl, 'finished': finished there} (the plugin's order)."""
    bad, finished = set(), set()
    for path in paths:
        g = read_group(path)
        bad |= {n for n, v in g["outcome"].items() if v == "failed"} | set(g["running"])
        finished |= set(g["outcome"])
    return {"bad": sorted(bad), "finished": sorted(finished - bad)}


class Suite:
    """The groups run so far and how each ended; writes the verdict."""

    def __init__(self, out: Path, name: str, test_seconds: float, copies: tuple[Path, ...] = ()):
        self.out, self.name, self.test_seconds, self.copies = out, name, test_seconds, copies
        self.groups: list[dict] = []  # {group, path, hung, state}
        self.cut: str | None = None  # once cut, every later rewrite (a shard's thread ending) still says so
        self.lock = threading.RLock()  # SIGTERM's handler may run in the main thread while it writes

    def verdict(self) -> str:
        cut = self.cut
        rows, sections, tally = [], [], {"ran": 0, "bad": 0, "open": 0}
        for grp in list(self.groups):  # shards' threads may add theirs meanwhile
            g = read_group(grp["path"])
            hung = grp["hung"]
            running = [n for n in g["running"] if n not in hung]
            not_run = [n for n in g["collected"] if n not in g["outcome"] and n not in hung and n not in running]
            count = {k: sum(1 for v in g["outcome"].values() if v == k) for k in ("passed", "failed", "skipped")}
            tally["ran"] += count["passed"] + count["failed"] + len(hung)
            tally["bad"] += count["failed"] + len(hung)
            tally["open"] += len(running) + len(not_run) + (grp["state"] != "ran to its end")
            rows.append(f"| {grp['group']} | {count['passed']} | {count['failed']} | {count['skipped']} | "
                        f"{len(hung)} | {len(running)} | {len(not_run)} | {len(g['dropped'])} | "
                        f"{grp['state'] or ('cut' if cut else 'running')} |")
            for n, reports in g["failures"].items():
                for r in reports:
                    sections += [f"### failed ({grp['group']}, {r['when']}): `{n}`", "", r.get("message", ""), "",
                                 "```", *r.get("traceback", []), "```", ""]
            sections += [f"- hung ({grp['group']}, over {self.test_seconds:g} s): `{n}`" for n in hung]
            sections += [f"- running when the suite was cut ({grp['group']}): `{n}`" for n in running]
            reasons: dict[str, int] = {}
            for reason in g["skips"].values():
                reasons[reason] = reasons.get(reason, 0) + 1
            sections += [f"- skipped ({grp['group']}) x{k}: {r}" for r, k in reasons.items()]
            if g["dropped"]:
                why = "; ".join(w for p, w in DUPLICATES if any(re.search(p, n) for n in g["dropped"]))
                sections += [f"- left out as duplicates ({grp['group']}) x{len(g['dropped'])}: {why}"]
            if not_run:
                sections += ["", f"Not run ({grp['group']}, {len(not_run)}):", *[f"- `{n}`" for n in not_run], ""]
            if g["outcome"]:
                sections += [f"Ran ({grp['group']}, {len(g['outcome'])}, in order; seconds):",
                             *[f"- {v} {g['seconds'].get(n) or 0:.2f} `{n}`" for n, v in g["outcome"].items()], ""]
        verdict = ("NOT green" if tally["bad"] else "incomplete" if tally["open"] or cut
                   else "green" if tally["ran"] else "no test ran (every one skipped: see the reasons)")
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        head = [f"# GPU suite verdict: {verdict}", "",
                f"Written {now}{f'; cut: {cut}' if cut else ''}. Every test under a {self.test_seconds:g} s "
                "limit; groups in the order run.", "",
                "| group | passed | failed | skipped | hung | running at the cut | not run | left out | ended |",
                "|---|---|---|---|---|---|---|---|---|", *rows, ""]
        return "\n".join(head + sections) + "\n"

    def write(self, cut: str | None = None) -> None:
        """Rewrite the verdict; `cut` (why the suite was cut) sticks to this and every later rewrite."""
        with self.lock:
            self.cut = cut or self.cut
            text = self.verdict()
            for folder in (self.out, *self.copies):
                path = folder / f"suite-{self.name}-verdict.md"
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)

    def all_ran_and_none_failed(self) -> bool:
        for grp in self.groups:
            g = read_group(grp["path"])
            if grp["hung"] or grp["state"] != "ran to its end" or "failed" in g["outcome"].values():
                return False
        return True


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Processes:
    """The suite's running pytest processes (one per shard); after `stop()` none starts (a shard's thread that
    finds its process ended by the stop must not restart it)."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self.stopped = False

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        with self._lock:
            if self.stopped:
                return None
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._running.append(proc)
            return proc

    def ended(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.remove(proc)

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            running = list(self._running)
        for proc in running:
            _end(proc)


def _copy(stream, log) -> None:
    for line in stream:
        log(line)


def run_group(suite: Suite, name: str, tma: bool, tests: list[str], deadline: float, reserve: float,
              order: Path | None, drop: bool, log, procs: Processes, shard: tuple[int, int] = (0, 1)) -> None:
    """Run one group (its shard i of n: every n-th test from the i-th) to its end (restarting after each hang)
    or to the deadline (time.time())."""
    outcomes, done = suite.out / f"suite-{name}.jsonl", suite.out / f"suite-{name}.done"
    outcomes.unlink(missing_ok=True)
    done.write_text("")
    grp = {"group": name, "path": outcomes, "hung": [], "state": None}
    suite.groups.append(grp)
    env = {**os.environ, ENV["outcomes"]: str(outcomes), ENV["done"]: str(done),
           ENV["test_seconds"]: str(suite.test_seconds), ENV["tma"]: str(int(tma)), ENV["deadline"]: str(deadline),
           ENV["reserve"]: str(reserve), ENV["drop"]: json.dumps([p for p, _ in DUPLICATES] if drop else []),
           ENV["shard"]: f"{shard[0]}/{shard[1]}",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    if order is not None:
        env[ENV["order"]] = str(order)
    cmd = [sys.executable, "-m", "pytest", "-p", "gpu_suite", "-p", "no:cacheprovider", "-c", "pyproject.toml",
           "--rootdir", ".", "-v", "-rfs", "-m", "gpu or interpret", *tests]
    while True:
        if deadline - time.time() <= reserve:
            grp["state"] = "time up"
            break
        log(f"$ {' '.join(cmd)}   # group {name}, {deadline - time.time():.0f}s left, "
            f"{suite.test_seconds:g}s per test\n")
        proc = procs.start(cmd, env)
        if proc is None:  # the suite is being stopped
            grp["state"] = "time up"
            break
        reader = threading.Thread(target=_copy, args=(proc.stdout, log), daemon=True)
        reader.start()
        size, cut = -1, False
        while proc.poll() is None:
            time.sleep(0.25)
            if outcomes.exists() and outcomes.stat().st_size != size:
                size = outcomes.stat().st_size
                suite.write()
            if time.time() >= deadline:
                log(f"[gpu_suite] group {name}: the suite's time is up, pytest ended\n")
                _end(proc)
                cut = True
        reader.join(timeout=5)
        procs.ended(proc)
        g = read_group(outcomes)
        new = [n for n in g["running"] if n not in grp["hung"]]
        if cut or g["stopped"]:
            grp["state"] = "time up"
            break
        if proc.returncode == -signal.SIGTERM or procs.stopped:  # a stage's limit reached pytest (timeout signals
            grp["state"] = "cut"                                  # its whole group) before this driver's handler
            break
        if not new:
            grp["state"] = "ran to its end"
            break
        grp["hung"] += new
        log(f"[gpu_suite] {new[-1]} hung: over its {suite.test_seconds:g}s, the process ended; "
            f"restarting group {name}\n")
        done.write_text("\n".join([*g["outcome"], *grp["hung"]]))
    suite.write()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder of the log and the verdict")
    p.add_argument("--seconds", type=float, default=300.0, help="all groups stop this long after the start")
    p.add_argument("--test-seconds", type=float, default=90.0, help="each test's limit")
    p.add_argument("--reserve", type=float, default=5.0,
                   help="no test starts with fewer seconds than this left of --seconds")
    p.add_argument("--tests", nargs="+", default=None, help="test paths (default: the GPU suite's)")
    p.add_argument("--group", action="append", choices=[g for g, _ in GROUPS],
                   help="run only this group (repeatable; default: all, in order)")
    p.add_argument("--prior", type=Path, action="append", default=[],
                   help="a previous run's jsonl: its failed and unfinished tests run first (repeatable)")
    p.add_argument("--drop-duplicates", action="store_true", help="leave out the tests of DUPLICATES")
    p.add_argument("--shards", type=int, default=1, help="pytest processes per group, run at once (default 1)")
    p.add_argument("--verdict-copy", type=Path, action="append", default=[],
                   help="a folder that gets every rewrite of the verdict too (a call's $OUT; repeatable)")
    args = p.parse_args(argv)
    for name, value in (("--seconds", args.seconds), ("--test-seconds", args.test_seconds)):
        if not value > 0:
            p.error(f"{name} must be > 0, got {value}")
    if args.reserve < 0:
        p.error(f"--reserve must be >= 0, got {args.reserve}")
    if args.shards < 1:
        p.error(f"--shards must be >= 1, got {args.shards}")
    for path in args.prior:
        if not path.is_file():
            p.error(f"--prior {path}: no such file")
    tests = args.tests or os.environ.get("GPU_SUITE_TESTS", "").split() or TESTS
    deadline = time.time() + args.seconds
    args.out.mkdir(parents=True, exist_ok=True)
    order = None
    if args.prior:
        order = args.out / "suite-prior-order.json"
        order.write_text(json.dumps(prior_order(args.prior)))
    groups = [(g, t) for g, t in GROUPS if args.group is None or g in args.group]
    name = "-".join(g for g, _ in groups) if args.group else "all"
    for folder in args.verdict_copy:
        folder.mkdir(parents=True, exist_ok=True)
    suite, procs = Suite(args.out, name, args.test_seconds, tuple(args.verdict_copy)), Processes()
    logging = threading.Lock()
    with open(args.out / f"suite-{name}.log", "w") as log_file:

        def log(text: str) -> None:
            with logging:  # the shards' readers write whole lines
                sys.stdout.write(text)
                sys.stdout.flush()
                log_file.write(text)
                log_file.flush()

        def on_sigterm(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            procs.stop()
            suite.write(cut="SIGTERM (the stage's outer time limit)")
            log("[gpu_suite] SIGTERM: pytest ended, verdict written\n")
            os._exit(143)

        signal.signal(signal.SIGTERM, on_sigterm)
        for group, tma in groups:
            shard_names = [group] if args.shards == 1 else [f"{group}.{i}" for i in range(args.shards)]
            threads = [threading.Thread(target=run_group, args=(
                suite, shard_name, tma, tests, deadline, args.reserve, order, args.drop_duplicates, log, procs,
                (i, args.shards))) for i, shard_name in enumerate(shard_names)]
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):  # joined in steps: SIGTERM runs in this thread
                for thread in threads:
                    thread.join(timeout=0.25)
        suite.write()
    print((args.out / f"suite-{name}-verdict.md").read_text())
    return 0 if suite.all_ran_and_none_failed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
