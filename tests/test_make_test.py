"""tools/make_test.sh (`make test`): its lanes run every stage even after one fails, each line prefixed with its
lane; a failed stage, a failed venv build or a lane that ends abnormally fails the whole run, named in its last line,
after each failed stage's last lines.
Run here with stand-ins for the venvs' pythons and for make."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from _scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "make_test.sh"
FAILING_PYTEST = ('echo "FAILED tests/t.py::t - AssertionError: planted"\n'  # pytest -rfEs: failures, then skips
                  'for i in $(seq 60); do echo "SKIPPED [1] tests/t.py:$i: a reason"; done\nexit 1')
VENVS = {"PY": "main", "TRITON36_PY": "t36", "VERL_PY": "verl", "VLLM_PY": "vllm", "VERIFIERS_PY": "vf"}


def _executable(path: Path, text: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, fail_pytest_of: dict[str, str] | None = None,
         fail_build: str = "") -> subprocess.CompletedProcess:
    """make_test.sh in tmp_path, each venv's python a stand-in that prints its venv and arguments (and, where
    `fail_pytest_of` names its venv, fails or kills its lane), make a stand-in that fails for the stamp `fail_build`."""
    fail_pytest_of = fail_pytest_of or {}
    env = {"PATH": os.environ["PATH"], "XDIST": "-n 2", "INTERPRET_SMOKE": "smoke_a smoke_b",
           "SUBMAKE": str(tmp_path / "make"), "STAMP": "main-stamp", "TRITON36_STAMP": "t36-stamp",
           "VERL_STAMP": "verl-stamp", "VLLM_STAMP": "vllm-stamp", "VERIFIERS_STAMP": "vf-stamp",
           "VLLM_VENV": "vllm", "VERIFIERS_VENV": "vf"}
    (tmp_path / "tests").mkdir()
    for name in ("test_vllm_agents", "test_vllm_train", "test_vllm_pipeline", "test_vllm_engine", "test_vllm_server"):
        (tmp_path / "tests" / f"{name}.py").write_text("")
    for var, venv in VENVS.items():
        (tmp_path / venv).mkdir()
        code = {"fail": FAILING_PYTEST, "kill": "kill -9 $PPID"}.get(fail_pytest_of.get(venv, ""), "exit 0")
        _executable(tmp_path / venv / "python", f'echo "ran {venv}: $*"\n{code}\n')
        env[var] = f"{venv}/python"
    _executable(tmp_path / "make", f'for s in "$@"; do [ "$s" = "{fail_build}" ] && exit 2; done; exit 0\n')
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_every_stage_runs_in_its_lane_and_a_green_run_exits_0(tmp_path):
    run = _run(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "ran main: -m pytest -n 2 -q -rfEs --junitxml=build/junit-unit.xml tests --ignore=tests/interpret" in lines
    assert "[kernels] ran main: -m pytest -q -rfEs smoke_a smoke_b" in lines
    assert "[kernels] ran t36: -m pytest -q -rfEs tests/test_kernel_compile.py" in lines
    assert any(line.startswith("[kernels] ran t36: -m pytest -n 2") and line.endswith("tests/interpret")
               for line in lines)
    assert "[vllm] ran verl: -m pytest -q -rfEs tests/test_integration_verl.py" in lines
    assert "[vllm] ran vllm: -m pytest -q -rfEs --junitxml=build/junit-vllm-runs.xml tests/test_vllm_agents.py " \
           "tests/test_vllm_train.py tests/test_vllm_pipeline.py" in lines
    assert "[services] ran vf: -m pytest -q -rfEs tests/test_verifiers_v04.py" in lines
    assert "[services] ran vllm: -m pytest -q -rfEs --junitxml=build/junit-vllm-engine.xml tests/test_vllm_engine.py " \
           "tests/test_vllm_server.py" in lines  # every other test_vllm file
    assert lines[-1].endswith("failed: none")


@pytest.mark.parametrize(("fail_pytest_of", "fail_build", "named"), [
    ({"vllm": "fail"}, "", "vllm-runs vllm-engine"), ({"t36": "fail"}, "", "compile-triton36 interpreter-triton36"),
    ({}, "vf-stamp", "venv-verifiers"), ({"main": "fail"}, "", "unit interpreter-smoke"),
    ({"vf": "kill"}, "", "services"),  # the lane itself killed: it left no record, so it is named
])
def test_a_failure_anywhere_fails_the_run_and_the_other_stages_still_run(tmp_path, fail_pytest_of, fail_build,
                                                                           named):
    run = _run(tmp_path, fail_pytest_of, fail_build)
    assert run.returncode == 1, run.stdout + run.stderr
    last = run.stdout.splitlines()[-1]
    assert set(last.split("failed:")[1].split()) == set(named.split()), last
    assert "[vllm] ran verl:" in run.stdout and "[kernels] ran t36: -m pytest -n 2" in run.stdout  # the rest ran
    lines = run.stdout.splitlines()
    for stage in set(named.split()) - {"services"}:  # each failed stage's output again at the end, before the verdict
        again = lines.index(f"== make test: the last lines of {stage} (build/stage-{stage}.log):")
        assert lines[again + 1].startswith(f"[{stage}] "), lines[again:]
        if not stage.startswith("venv-"):  # a pytest stage: its failure summary is not lost behind its skips
            assert f"[{stage}] FAILED tests/t.py::t - AssertionError: planted" in lines[again:], lines[again:]


def test_a_venv_that_does_not_build_skips_the_unit_stage_and_the_kernels_lane(tmp_path):
    run = _run(tmp_path, fail_build="main-stamp")
    assert run.returncode == 1 and "[kernels]" not in run.stdout and "ran main:" not in run.stdout
    assert "[vllm] ran verl:" in run.stdout and run.stdout.splitlines()[-1].endswith("failed: venv")


def test_harness_wheels_reads_the_programs_pep_723_dependencies():
    script_dependencies = load_script(SCRIPT.parent / "harness_wheels.py", "harness_wheels").script_dependencies
    program = '#!/usr/bin/env python\n# /// script\n# requires-python = ">=3.10"\n' \
              '# dependencies = ["openai", "mcp==2.0.0"]\n# ///\nimport mcp\n'
    assert script_dependencies(program) == ["openai", "mcp==2.0.0"]
    with pytest.raises(ValueError, match="no '# /// script' block"):
        script_dependencies("import mcp\n")
