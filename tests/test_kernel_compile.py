"""Every Triton kernel compiles ahead of time, without a GPU, for each architecture it is launched on at its
launch configuration (`ludic_fast.kernels.aot.SPECS`): no register spills, shared memory within the
architecture's limit, and the bf16 tl.dot kernels use mma.sync on sm_80 and wgmma on sm_90 (the fp32
variants use exact "ieee" FMA dots); the TMA variants (sm_90) load through TMA, the others do not."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's warning; 1 is its current default

from ludic_fast.kernels.aot import SPECS, compile_spec, resource_usage, signature  # noqa: E402

#: opt-in shared memory per block (bytes): A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
CASES = [(spec, arch) for spec in SPECS for arch in spec.archs]
#: one launch configuration per kernel function
ONE_PER_KERNEL = list({spec.fn: spec for spec in reversed(SPECS)}.values())


@pytest.mark.parametrize("spec,arch", CASES, ids=[f"{s.name}-sm_{a}" for s, a in CASES])
def test_kernel_compiles(spec, arch):
    compiled = compile_spec(spec, arch)
    usage = resource_usage(compiled, arch)
    assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0 and usage["local"] == 0, usage
    assert usage["shared"] <= SHARED_LIMIT[arch], usage
    assert compiled.asm["cubin"], "no cubin"
    assert f".target sm_{arch}" in compiled.asm["ptx"]
    if spec.tensor_cores:
        assert ("wgmma" in compiled.asm["ptx"]) == (arch >= 90)
        assert ("mma.sync" in compiled.asm["ptx"]) == (arch < 90)
    # TMA loads (cp.async.bulk.tensor) exactly in the TMA variants, which exist for sm_90 only
    tma = bool(spec.constexprs.get("TMA"))
    assert ("cp.async.bulk.tensor" in compiled.asm["ptx"]) == tma
    assert not tma or arch >= 90


@pytest.mark.parametrize("spec", ONE_PER_KERNEL, ids=[s.name for s in ONE_PER_KERNEL])
def test_kernel_compiles_when_its_integer_arguments_are_one(spec):
    """Triton's JIT turns an integer argument equal to 1 into a constant (a Python int, without `.to`): one row,
    one split, one block per split must compile too (a GPU run met `n_splits.to(...)` failing so)."""
    sig, _, _ = signature(spec)
    ones = {arg: 1 for arg, kind in sig.items() if kind == "i32"}
    assert ones, spec.name
    compiled = compile_spec(spec._replace(constexprs={**spec.constexprs, **ones}), spec.archs[-1])
    assert compiled.asm["cubin"], "no cubin"
