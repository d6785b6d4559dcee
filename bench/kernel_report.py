"""Kernel report: (1) compile every ludic_fast Triton kernel ahead of time for sm_80 and sm_90 (no GPU
needed) and print one line per kernel x architecture: registers, stack, local memory and spill bytes,
shared memory, wgmma; (2) the FLOP / byte model of both strategies at one shape, with time floors.

    .venv/bin/python bench/kernel_report.py                     # both parts, N=8192 D=4096 V=151936
    .venv/bin/python bench/kernel_report.py --model-only --shape 4096 2048 32000
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 = its current default

from ludic_fast.kernels import head_bwd, head_fwd  # noqa: E402
from ludic_fast.kernels.aot import ARCHS, SPECS, compile_spec, resource_usage  # noqa: E402

from ludic_fast.ops.torch_head import DEFAULT_CHUNK_ELEMENTS  # noqa: E402
from ludic_fast.ops.triton_head import fused_splits, grad_blocks  # noqa: E402


def compile_report() -> None:
    print(f"{'kernel':<16} {'arch':<6} {'regs':>5} {'stack':>6} {'local':>6} {'spill st/ld':>12} "
          f"{'shared':>8} {'wgmma':>6}  config")
    for spec in SPECS:
        for arch in ARCHS:
            u = resource_usage(compile_spec(spec, arch), arch)
            blocks = {k: v for k, v in spec.constexprs.items() if k.startswith(("BLOCK", "ROWS"))}
            wgmma = ("yes" if u["wgmma"] else "no") if arch >= 90 else "-"
            print(f"{spec.name:<16} sm_{arch:<3} {u['regs']:>5} {u['stack']:>6} {u['local']:>6} "
                  f"{u['spill_stores']:>5}/{u['spill_loads']:<6} {u['shared']:>8} {wgmma:>6}  {blocks} {spec.options}")


def cost_model(n: int, d: int, v: int, elem: int = 2, budget: int = DEFAULT_CHUNK_ELEMENTS) -> list[tuple]:
    """[(strategy, phase, FLOPs, bytes, note)] for bf16 (elem=2) inputs, fp32 statistics/accumulators.

    Bytes count DRAM/L2 traffic assuming operand re-reads inside one launch hit L2 (a lower bound), plus
    every fp32 atomic / read-modify-write of dh, dW (which is L2 traffic at best, DRAM at worst)."""
    ndv = n * d * v
    hb, wb = n * d * elem, v * d * elem
    rows = []
    # fused forward: grid (N/BM token tiles) x (S vocab splits); h re-read per split, W once per split set
    s, _ = fused_splits(n, v, elem)
    fwd_cfg, bwd_cfg = head_fwd.CONFIGS[elem], head_bwd.CONFIGS[elem]
    w_rereads = (math.ceil(n / fwd_cfg["BLOCK_M"]) - 1) * wb
    rows.append(("fused", "fwd", 2 * ndv, wb + s * hb + 2 * 4 * s * n * 4 + 4 * n * 4,
                 f"{s} vocab splits; W re-read per token tile if L2 misses: +{w_rereads / 1e9:.0f} GB"))
    # fused backward: recompute + two gradient products per (BM x BN) tile, fp32 atomics into dh and dW
    dh_atomic = math.ceil(v / bwd_cfg["BLOCK_N"]) * n * d * 4
    dw_atomic = math.ceil(n / bwd_cfg["BLOCK_M"]) * v * d * 4
    rows.append(("fused", "bwd", 6 * ndv, 2 * (hb + wb) + dh_atomic + dw_atomic + (n * d + v * d) * (4 + elem),
                 f"atomics dh {dh_atomic / 1e9:.0f} GB + dW {dw_atomic / 1e9:.0f} GB"))
    # workspace forward: chunks of whole vocab rows; cuBLAS streams W once per chunk; fp32 ws written + read
    chunk_rows = max(1, budget // v)
    chunks = math.ceil(n / chunk_rows)
    rows.append(("workspace", "fwd", 2 * ndv, chunks * wb + hb + 2 * n * v * 4,
                 f"{chunks} chunks x {chunk_rows} rows; fp32 logits written+read {2 * n * v * 4 / 1e9:.1f} GB"))
    # workspace backward: vocab slices over all tokens (every dW row from one GEMM)
    r, c = grad_blocks(n, v, budget)
    slices, row_chunks = math.ceil(v / c), math.ceil(n / r)
    per_elem = 4 + 2 * 4 + (4 + elem) + 2 * elem + 4  # GEMM write, kernel r+w, cast, 2 GEMM reads, db read
    dh_bytes = slices * 4 * n * d * 4 + n * d * (4 + elem)  # fp32 GEMM temp + `dh +=` per slice, final cast
    # one token chunk: each dW slice is one GEMM (fp32 temp, cast into the weight dtype); else fp32 accumulation
    dw_bytes = v * d * (8 + elem) if row_chunks == 1 else row_chunks * 4 * v * d * 4 + v * d * (4 + elem)
    bwd_bytes = n * v * per_elem + slices * 3 * hb + row_chunks * 3 * wb + dh_bytes + dw_bytes
    rows.append(("workspace", "bwd", 6 * ndv, bwd_bytes, f"{slices} vocab slices x {row_chunks} token chunks"))
    return rows


def model_report(n: int, d: int, v: int, tflops: float = 800.0, tbps: float = 3.35) -> None:
    print(f"\nFLOP/byte model at N={n} D={d} V={v}, bf16 inputs, fp32 workspace, chunk budget "
          f"{DEFAULT_CHUNK_ELEMENTS} elements; floors at {tflops:.0f} TFLOP/s and {tbps} TB/s")
    print(f"{'strategy':<10} {'phase':<6} {'TFLOP':>7} {'GB':>7} {'t_flop ms':>10} {'t_byte ms':>10} "
          f"{'max ms':>8} {'sum ms':>8}  note")
    for strategy, phase, flops, nbytes, note in cost_model(n, d, v):
        tf, tb = flops / tflops / 1e9, nbytes / tbps / 1e9
        print(f"{strategy:<10} {phase:<6} {flops / 1e12:>7.2f} {nbytes / 1e9:>7.1f} {tf:>10.1f} {tb:>10.1f} "
              f"{max(tf, tb):>8.1f} {tf + tb:>8.1f}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=3, type=int, default=(8192, 4096, 151936), metavar=("N", "D", "V"))
    parser.add_argument("--model-only", action="store_true", help="skip the AOT compile part")
    args = parser.parse_args()
    if not args.model_only:
        compile_report()
    model_report(*args.shape)


if __name__ == "__main__":
    main()
