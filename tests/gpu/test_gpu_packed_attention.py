"""The packed-attention kernels (bench/packed_attention.py) in bf16 on the test's device, at the Qwen2.5-0.5B head
layout (14 query / 2 key-value heads, d 64), sequences that cut and fill flex's 128-token tiles: each path's output
and dq / dk / dv against float64 attention of each sequence alone, allowed K = 4 times the error of plain SDPA on
the padded batch (is_causal) — the bf16 rounding of a kernel everyone trusts, measured on the same inputs. CUDA:
the jagged one-call path, PyTorch's flash varlen kernel (sdpa_varlen's CUDA path), flex, flash-attn varlen when
installed; CPU: the paths the CPU runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from _gpu import CUDA_ONLY, on
from _scripts import load_script

BENCH = Path(__file__).resolve().parents[2] / "bench" / "packed_attention.py"
LENGTHS = [5, 1, 300, 128, 64, 17]
K = 4.0
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64
FLASH = importlib.util.find_spec("flash_attn") is not None


def _bench():
    return load_script(BENCH, "packed_attention_bench")


def _errors(bench, path: str, device: torch.device) -> dict[str, float]:
    setup, run = bench.make_path(path, bench.Layer(HEADS, KV_HEADS))
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    q, k, v, grad = bench.inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, device, seed=1)
    return bench.errors(run, setup(cu, device), q, k, v, grad, LENGTHS)


PATHS = [
    *(on(d, p, id=f"{d}-{p}") for d in ("cpu", "cuda") for p in ("padded-mask", "dense-mask", "sdpa-loop")),
    on("cuda", "sdpa-nested", id="cuda-sdpa-nested"), on("cuda", "sdpa-flash", id="cuda-sdpa-flash"),
    on("cuda", "flex", id="cuda-flex"),
    pytest.param("cuda", "flash-varlen", id="cuda-flash-varlen",
                 marks=(*CUDA_ONLY, pytest.mark.skipif(not FLASH, reason="needs flash-attn"))),
]


@pytest.mark.parametrize(("device", "path"), PATHS)
def test_path_within_k_times_padded_sdpa_rounding(device, path):
    torch._dynamo.reset()
    bench, dev = _bench(), torch.device(device)
    assert bench.unavailable(path, dev, torch.bfloat16, HEAD_DIM) is None
    got, noise = _errors(bench, path, dev), _errors(bench, "padded-causal", dev)
    assert all(noise[n] > 0 for n in noise), noise  # bf16 rounding is there to measure
    bad = {n: (got[n], noise[n]) for n in got if not got[n] <= K * noise[n]}
    assert not bad, f"{device} {path}: error vs float64 above {K} x padded SDPA's (got, padded): {bad}; all: {got}"
