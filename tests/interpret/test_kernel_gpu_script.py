"""bench/kernel_gpu.py (kernel timings on a GPU) runs end to end: on the GPU when there is one, else on the CPU
under the interpreter at a tiny shape (a smoke test; its timings are not checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from _interp import DEVICE, MARKS

pytestmark = MARKS

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernel_gpu.py"


def test_kernel_gpu_script_runs(capsys):
    spec = importlib.util.spec_from_file_location("kernel_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--device", DEVICE, "--shape", "3", "40", "300", "--rows", "4", "--reps", "1"])
    out = capsys.readouterr().out
    lines = ["cuBLAS logits GEMM", "fused forward default", "fused forward 128x256x64", "grad kernel default",
             "device copy", "row kernel statistics", "row kernel gradient"]
    if DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9:  # the TMA variants: sm_90 (the CPU runs as it)
        lines += ["fused forward tma", "grad kernel tma+persistent"]
    for line in lines:
        assert line in out, out
