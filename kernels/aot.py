"""Ahead-of-time compilation of every kernel at its default launch configuration, without a GPU.

`SPECS` names each kernel with representative constexprs (every optional feature on, so the largest
variant is checked; the tl.dot kernels — the fused forward and the fused backward's gradient kernel — once
per launch configuration (`head_fwd.CONFIGS` / `SMALL_CONFIGS`, `head_grad.CONFIGS`), compiled for the
architecture it is chosen on, plus the plain variant: no bias, no softcap). `compile_spec(spec, arch)` runs
`triton.compile` for a CUDA `GPUTarget` (80 -> sm_80, 90 -> sm_90a).
`resource_usage` reads registers / stack / local memory from `cuobjdump --dump-resource-usage` and spill
bytes from `ptxas -v` (the ptxas triton itself uses for that arch), both shipped in triton's
backends/nvidia/bin.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from . import divergence_rows, head_fwd, head_grad, head_merge, head_rows

ARCHS = (80, 90)
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class KernelSpec(NamedTuple):
    name: str
    fn: Any  # triton JITFunction
    pointer_types: dict[str, str]  # argument -> "*bf16", "fp32" etc. (pointers default to *fp32, scalars to i32)
    constexprs: dict[str, Any]
    options: dict[str, int]
    tensor_cores: bool  # tl.dot on bf16/fp16 operands: mma.sync on sm_80, wgmma on sm_90
    archs: tuple[int, ...] = ARCHS  # architectures this variant is launched on


_TRANSFORM = {"SCALE": 1.0, "HAS_SOFTCAP": True, "SOFTCAP": 30.0}
_PLAIN = {"HAS_BIAS": False, "SCALE": 1.0, "HAS_SOFTCAP": False, "SOFTCAP": 1.0}
_DOT_DTYPES = {2: ("bf16", "tf32"), 4: ("fp32", "ieee")}  # element size -> (pointer dtype, tl.dot precision)


def _split(config: dict) -> tuple[dict, dict]:
    """A launch config -> (BLOCK_* constexprs, compile options)."""
    opts = ("num_warps", "num_stages")
    return {k: v for k, v in config.items() if k not in opts}, {k: v for k, v in config.items() if k in opts}


def _dot_operand_types(dtype: str, config: dict) -> dict[str, str]:
    """Signature types of h_src and w_src: TMA descriptors of the config's tiles, or typed pointers."""
    if not config.get("TMA"):
        return {"h_src": f"*{dtype}", "w_src": f"*{dtype}"}
    bm, bn, bk = (config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    return {"h_src": f"tensordesc<{dtype}[{bm}, {bk}]>", "w_src": f"tensordesc<{dtype}[{bn}, {bk}]>"}


def _dot_specs(name: str, fn: Any, features: dict[str, Any], io: dict[str, str], tables) -> list[KernelSpec]:
    """A tl.dot kernel per launch configuration of `tables` ((label, {(elem, arch): config})), compiled for the
    architecture it is chosen on; all features on (bias, softcap, `features`) and the plain variant."""
    specs = []
    for label, table in tables:
        for (elem, arch), config in table.items():
            dtype, precision = _DOT_DTYPES[elem]
            blocks, options = _split(config)
            ptrs = {**_dot_operand_types(dtype, config), "b_ptr": f"*{dtype}", "tgt_ptr": "*i32",
                    **{k: v.format(dtype=dtype) for k, v in io.items()}}
            base = {**features, "UPCAST": False, "PRECISION": precision, **blocks}
            for variant, feats in (("all", {"HAS_BIAS": True, **_TRANSFORM}), ("plain", _PLAIN)):
                specs.append(KernelSpec(f"{name}[{dtype},{label}{variant}]", fn, ptrs, {**feats, **base}, options,
                                        precision != "ieee", (arch,)))
    return specs


SPECS = (
    *_dot_specs("head_fwd", head_fwd.head_fwd_kernel, {"ENTROPY": True, **head_fwd.POINTER_LOADS}, {},
                (("", head_fwd.CONFIGS), ("small-N ", head_fwd.SMALL_CONFIGS), ("tma ", head_fwd.TMA_CONFIGS),
                 ("small-N tma ", head_fwd.SMALL_TMA_CONFIGS))),
    *_dot_specs("head_grad", head_grad.head_grad_kernel, {"HAS_GH": True, **head_grad.POINTER_LOADS},
                {"d_ptr": "*{dtype}"}, (("", head_grad.CONFIGS), ("tma ", head_grad.TMA_CONFIGS))),
    KernelSpec(
        "head_merge", head_merge.head_merge_kernel, {"tgt_ptr": "*i32"},
        {"ENTROPY": True, "BLOCK": head_merge.BLOCK}, {"num_warps": head_merge.NUM_WARPS}, False,
    ),
    KernelSpec(  # fp32 raw logits in, bf16 d(raw) out over the same memory (NARROW)
        "head_rows", head_rows.head_rows_kernel,
        {"ws_ptr": "*fp32", "d_ptr": "*bf16", "b_ptr": "*bf16", "tgt_ptr": "*i32"},
        {"HAS_BIAS": True, **_TRANSFORM, "ENTROPY": True, "STATS": True, "GRAD": True, "HAS_GH": True,
         "NARROW": True, "ROWS": head_rows.ROWS, "BLOCK_V": head_rows.BLOCK_V},
        {"num_warps": head_rows.NUM_WARPS}, False,
    ),
    *(KernelSpec(  # every feature on: biases, softcap, hard labels, entropy, the gradient sweep; per divergence kind
        f"divergence_rows[{kind}]", divergence_rows.divergence_rows_kernel,
        {"tgt_ptr": "*i32", "beta": "fp32", "hard": "fp32"},
        {"KIND": k, "HAS_BS": True, "HAS_BT": True, "HARD": True, "GRAD": True, "T_LOGITS": True, **_TRANSFORM,
         "ENTROPY": True, "BLOCK_V": divergence_rows.BLOCK_V},
        {"num_warps": divergence_rows.NUM_WARPS}, False,
    ) for k, kind in enumerate(("forward_kl", "reverse_kl", "jsd"))),
)


#: How the JIT specializes the common case (contiguous inputs, D and V multiples of 16, e.g. 4096 x 151936):
#: unit strides become constexpr 1, pointers and these integers get 16-divisibility hints.
UNIT_STRIDES = ("stride_hk", "stride_wk")
DIVISIBLE_BY_16 = ("D", "V", "stride_hn", "stride_wv", "stride_ws", "stride_d")


def signature(spec: KernelSpec) -> tuple[dict[str, str], dict[str, object], dict[tuple[int], list]]:
    """(signature, constexprs, attrs) for ASTSource: typed pointers, i32 scalars, JIT-like specialization."""
    sig, constexprs, attrs = {}, dict(spec.constexprs), {}
    for i, arg in enumerate(spec.fn.arg_names):
        if arg in UNIT_STRIDES:
            constexprs[arg] = 1
        if arg in constexprs:
            sig[arg] = "constexpr"
            continue
        sig[arg] = spec.pointer_types.get(arg, "*fp32" if arg.endswith("_ptr") else "i32")
        if sig[arg].startswith("*") or arg in DIVISIBLE_BY_16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def compile_spec(spec: KernelSpec, arch: int):
    """triton.compile for CUDA `arch` (80 or 90); the result's .asm has 'ptx' and 'cubin'."""
    sig, constexprs, attrs = signature(spec)
    src = ASTSource(fn=spec.fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(spec.options))


def resource_usage(compiled, arch: int) -> dict[str, int | bool]:
    """{'regs', 'stack', 'local', 'spill_stores', 'spill_loads', 'shared', 'wgmma', 'tma'} of a compiled kernel
    ('tma': TMA loads, `cp.async.bulk.tensor`, in its PTX)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        ptx = os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        dump = subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), "--dump-resource-usage", cubin],
                              capture_output=True, text=True, check=True).stdout
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        ptxas = subprocess.run([get_ptxas(arch).path, f"-arch={sm}", "-v", ptx, "-o", os.devnull],
                               capture_output=True, text=True, check=True).stderr
    usage = {key.lower(): int(val) for key, val in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", dump)}
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    usage["regs"] = usage.pop("reg")
    usage["spill_stores"], usage["spill_loads"] = (int(spill.group(1)), int(spill.group(2))) if spill else (0, 0)
    usage["shared"] = int(compiled.metadata.shared)
    usage["wgmma"] = "wgmma" in compiled.asm["ptx"]
    usage["tma"] = "cp.async.bulk.tensor" in compiled.asm["ptx"]
    return usage
