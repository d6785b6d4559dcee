"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 at its default launch configuration
(`ludic_fast.kernels.aot.SPECS`; no GPU needed), and the bf16 tl.dot kernels use mma.sync on sm_80 and
wgmma on sm_90 (the fp32 variants use exact "ieee" FMA dots)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's warning; 1 is its current default

from ludic_fast.kernels.aot import ARCHS, SPECS, compile_spec  # noqa: E402


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_kernel_compiles(spec, arch):
    compiled = compile_spec(spec, arch)
    assert compiled.asm["cubin"], "no cubin"
    assert f".target sm_{arch}" in compiled.asm["ptx"]
    if spec.tensor_cores:
        assert ("wgmma" in compiled.asm["ptx"]) == (arch >= 90)
        assert ("mma.sync" in compiled.asm["ptx"]) == (arch < 90)
