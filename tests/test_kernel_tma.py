"""The TMA variant of the tl.dot kernels is opt-in and applies only where TMA can: `tma_ready` (16-byte aligned
base and row stride, unit column stride), bf16/fp16 on sm_90 (`launch_config` / `grad_config`), env
LUDIC_FAST_TMA=1; a TMA launch on tensors TMA cannot cover is refused with a ValueError."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from ludic_fast.kernels.head_fwd import launch_config, launch_head_fwd  # noqa: E402
from ludic_fast.kernels.head_grad import grad_config  # noqa: E402
from ludic_fast.kernels.tma import descriptor, tma_ready  # noqa: E402

from ludic_fast.ops.triton_head import tma_requested  # noqa: E402


def _offset(rows: int, cols: int, dtype: torch.dtype, by: int) -> torch.Tensor:
    """A contiguous [rows, cols] view whose base is `by` elements past a fresh (aligned) allocation."""
    return torch.zeros(rows * cols + by, dtype=dtype)[by:].view(rows, cols)


def test_tma_ready_checks_alignment_and_strides():
    assert tma_ready(torch.zeros(3, 40, dtype=torch.bfloat16), torch.zeros(1021, 40, dtype=torch.bfloat16))
    assert tma_ready(torch.zeros(3, 36, dtype=torch.float32))  # 144-byte rows
    assert not tma_ready(torch.zeros(3, 36, dtype=torch.bfloat16))  # 72-byte rows
    assert not tma_ready(torch.zeros(3, 80, dtype=torch.bfloat16)[:, ::2])  # column stride 2
    assert not tma_ready(torch.zeros(40, 3, dtype=torch.bfloat16).T)  # column-major
    assert not tma_ready(_offset(3, 40, torch.bfloat16, 1))  # base 2 bytes off
    assert tma_ready(_offset(3, 40, torch.bfloat16, 8))  # base 16 bytes off
    assert not tma_ready(torch.zeros(0, 40, dtype=torch.bfloat16))
    assert not tma_ready(torch.zeros(3, 4, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not TMA-aligned"):
        descriptor(_offset(3, 40, torch.bfloat16, 1), (64, 64))


def test_tma_configs_exist_for_bf16_fp16_on_sm90_only():
    for n in (3, 8192):
        assert launch_config(2, 90, n, tma=True)["TMA"] and launch_config(2, 90, n, tma=True)["FLATTEN"]
        tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
        assert all(launch_config(2, 90, n, tma=True)[k] == launch_config(2, 90, n)[k] for k in tiles)
        for elem, arch in ((2, 80), (4, 90), (4, 80)):
            assert launch_config(elem, arch, n, tma=True) == launch_config(elem, arch, n)
            assert not launch_config(elem, arch, n, tma=True).get("TMA")
        assert not launch_config(2, 90, n).get("TMA")
    assert grad_config(2, 90, tma=True)["TMA"] and grad_config(2, 90, tma=True)["PERSISTENT"]
    for elem, arch in ((2, 80), (4, 90), (4, 80)):
        assert not grad_config(elem, arch, tma=True).get("TMA")
    assert not grad_config(2, 90).get("TMA")


def test_tma_is_off_by_default(monkeypatch):
    monkeypatch.delenv("LUDIC_FAST_TMA", raising=False)
    assert not tma_requested()
    monkeypatch.setenv("LUDIC_FAST_TMA", "1")
    assert tma_requested()


def test_a_tma_launch_on_unaligned_tensors_is_refused():
    h = _offset(3, 40, torch.bfloat16, 1)
    w = torch.zeros(1021, 40, dtype=torch.bfloat16)
    part = torch.empty(4, 1, 3)
    tgt, inv_t = torch.zeros(3, dtype=torch.int32), torch.ones(3)
    with pytest.raises(ValueError, match="not TMA-aligned"):
        launch_head_fwd(
            h,
            w,
            None,
            tgt,
            inv_t,
            part,
            4,
            scale=1.0,
            softcap=None,
            entropy=True,
            upcast=True,
            precision="tf32",
            config=launch_config(2, 90, 3, tma=True),
        )
