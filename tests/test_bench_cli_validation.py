"""`ludic-fast bench` input errors: each bad argument is refused before any case runs, in one line on stderr
naming the flag (argparse's form, `ludic-fast bench: error: ...`), with exit status 2; the report names the
CPU it ran on."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ludic_fast.benchmark import cli


@pytest.fixture
def no_run(monkeypatch):
    """Any benchmark case starting, or any output being written, fails the test: the checks come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark started before the arguments were checked")

    monkeypatch.setattr(cli, "run_suite", refuse)
    monkeypatch.setattr(cli, "write_outputs", refuse)


def one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ludic-fast bench: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--n", "-5"], "argument --n: must be >= 1, got -5"),
        (["--n", "0"], "argument --n: must be >= 1, got 0"),
        (["--n", "64,x"], "argument --n: 'x' is not an integer"),
        (["--d", ","], "argument --d: expected a comma list, got ','"),
        (["--v", "0"], "argument --v: must be >= 1, got 0"),
        (["--shapes", "48x16"], "argument --shapes: '48x16' is not NxDxV"),
        (["--shapes", "48x0x257"], "argument --shapes: must be >= 1, got 0"),
        (["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
        (["--check-tokens", "-2"], "argument --check-tokens: must be >= 0, got -2"),
        (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
        (["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
        (["--impls", "ours-fused,nope"], "argument --impls: unknown implementation nope; choose from cce,"),
        (["--workloads", "head,zz"], "argument --workloads: unknown workload zz; choose from cispo,"),
        (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        (["--device", "gpu0"], "--device 'gpu0' is not a torch device"),
        (["--device", "cpu", "--n", "1"], "--shapes/--n/--seq-len: Shape needs sequences of >= 2 tokens"),
        (["--render", "nope.json"], "--render nope.json: no such file"),
    ],
)
def test_bad_arguments(capsys, no_run, argv, message):
    assert message in one_line_error(capsys, argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda(capsys, no_run):
    line = one_line_error(capsys, ["--device", "cuda"])
    assert "--device cuda: CUDA is not available on this machine; use --device cpu" in line


def test_out_under_a_regular_file(capsys, no_run, tmp_path):
    (tmp_path / "file").write_text("")
    line = one_line_error(capsys, ["--device", "cpu", "--out", str(tmp_path / "file" / "sub")])
    assert f"--out {tmp_path / 'file' / 'sub'}: cannot write there (Not a directory)" in line
    line = one_line_error(capsys, ["--device", "cpu", "--out", str(tmp_path / "file")])
    assert "exists and is not a folder" in line


def test_render_checks_its_file_and_refuses_run_flags(capsys, no_run, tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"results": []}))  # no "meta"
    assert f"--render {bad}: not a results.json of ludic-fast bench" in one_line_error(capsys, ["--render", str(bad)])
    bad.write_text("{not json")
    assert "not a results.json of ludic-fast bench" in one_line_error(capsys, ["--render", str(bad)])
    line = one_line_error(capsys, ["--render", str(bad), "--repeats", "5"])
    assert "--render redraws a results.json and takes only --out; --repeats does not apply" in line


def test_the_command_exits_2_with_one_line():
    """Through `ludic-fast bench` in its own process: status 2, one line, no traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import sys; from ludic_fast.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "bench", "--n", "-5"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "ludic-fast bench: error: argument --n: must be >= 1, got -5 (see --help)\n"


def test_the_report_names_the_cpu_model():
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    models = {line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")}
    if not models:
        pytest.skip("this machine's /proc/cpuinfo names no CPU model")
    assert cli.cpu_name() in {f"{m} ({platform.machine()})" for m in models}
