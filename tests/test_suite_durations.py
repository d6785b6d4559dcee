"""tools/suite_durations.py: seconds per test file and the slowest tests, from a hand-written JUnit XML."""

from __future__ import annotations

from pathlib import Path

import pytest
from _scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "suite_durations.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
  <testcase classname="tests.test_a" name="test_one" time="1.5"/>
  <testcase classname="tests.test_a.TestGroup" name="test_two" time="2.0"><skipped message="no"/></testcase>
  <testcase classname="tests.gpu.test_b" name="test_three[x]" time="4.0"><failure message="boom"/></testcase>
  <testcase classname="tests.test_c" name="test_four" time="0.5"/>
</testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def durations():
    return load_script(SCRIPT, "suite_durations")


def test_seconds_per_file_sum_their_tests_classes_included(durations, tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    cases = durations.test_cases(path)
    assert [(f, o) for f, _, _, o in cases] == [("tests/test_a.py", "passed"), ("tests/test_a.py", "skipped"),
                                                ("tests/gpu/test_b.py", "failure"), ("tests/test_c.py", "passed")]
    assert durations.per_file(cases) == [("tests/gpu/test_b.py", 4.0, 1), ("tests/test_a.py", 3.5, 2),
                                         ("tests/test_c.py", 0.5, 1)]
    text = durations.report(cases, top=2)
    assert "4 tests, 8 s in all" in text
    assert "| tests/gpu/test_b.py | 4.0 | 50.0% | 1 |" in text and "test_c.py |" not in text
    assert "| tests/gpu/test_b.py::test_three[x] | 4.0 | failure |" in text


def test_an_unreadable_file_is_refused_in_one_line(durations, tmp_path, capsys):
    bad = tmp_path / "junit.xml"
    bad.write_text("<testsuites>")
    assert durations.main([str(bad)]) == 2
    assert "not a readable JUnit XML file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        durations.main([str(bad), "--top", "0"])
