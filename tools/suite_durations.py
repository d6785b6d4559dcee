"""Where a pytest run's time goes, from its JUnit XML (`pytest --junitxml=FILE`; make test writes
build/junit-<stage>.xml): seconds per test file (setup, call and teardown of its tests together, so a
module-scoped fixture counts in the file whose first test built it) and the slowest tests.

    python tools/suite_durations.py build/junit-unit.xml              # top 25 files, top 25 tests
    python tools/suite_durations.py build/junit-unit.xml --top 50

Under pytest-xdist the seconds are summed over the workers: with two workers busy all the time, the stage's
wall time is about half the total printed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_cases(path: Path) -> list[tuple[str, str, float, str]]:
    """(file, test name, seconds, outcome) of every testcase in the JUnit XML at `path`."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise ValueError(f"{path}: not a readable JUnit XML file ({exc})") from None
    cases = []
    for case in root.iter("testcase"):
        dotted = case.get("classname", "").split(".")  # tests.test_x or tests.test_x.TestClass
        file = "/".join(itertools.takewhile(lambda part: not part[:1].isupper(), dotted)) + ".py"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        cases.append((file, case.get("name", "?"), float(case.get("time", 0.0)), outcome))
    return cases


def per_file(cases: list[tuple[str, str, float, str]]) -> list[tuple[str, float, int]]:
    """(file, seconds, tests) per file, slowest first."""
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for file, _, t, _ in cases:
        seconds[file] += t
        counts[file] += 1
    return sorted(((f, seconds[f], counts[f]) for f in seconds), key=lambda row: -row[1])


def report(cases: list[tuple[str, str, float, str]], top: int) -> str:
    """Markdown tables: the total, the `top` slowest files and the `top` slowest tests."""
    total = sum(t for _, _, t, _ in cases)
    lines = [f"{len(cases)} tests, {total:.0f} s in all (summed over workers)", "",
             "| file | s | share | tests |", "|---|---|---|---|"]
    for file, t, n in per_file(cases)[:top]:
        lines.append(f"| {file} | {t:.1f} | {t / total:.1%} | {n} |" if total else f"| {file} | {t:.1f} | - | {n} |")
    lines += ["", "| test | s | outcome |", "|---|---|---|"]
    for file, name, t, outcome in sorted(cases, key=lambda c: -c[2])[:top]:
        lines.append(f"| {file}::{name} | {t:.1f} | {outcome} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    try:
        print(report(test_cases(args.junit_xml), args.top))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
