"""Kernel report: (1) compile every ludic_fast Triton kernel ahead of time for the architectures it is launched
on (no GPU needed) and print one line per kernel x architecture: registers, stack, local memory and spill bytes,
shared memory, wgmma, TMA loads; (2) the bytes each path moves per element of the [rows, V] logits, and its traffic
at one shape.

    .venv/bin/python bench/kernel_report.py                     # both parts, N=8192 D=4096 V=151936
    .venv/bin/python bench/kernel_report.py --model-only --shape 4096 2048 32000
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 = its current default

import triton  # noqa: E402
from ludic_fast.kernels.aot import SPECS, compile_spec, resource_usage  # noqa: E402


def compile_report() -> None:
    print(f"triton {triton.__version__}")
    print(f"{'kernel':<34} {'arch':<6} {'regs':>5} {'stack':>6} {'local':>6} {'spill st/ld':>12} "
          f"{'shared':>8} {'wgmma':>6} {'tma':>4}  config")
    for spec in SPECS:
        for arch in spec.archs:
            u = resource_usage(compile_spec(spec, arch), arch)
            blocks = {k: v for k, v in spec.constexprs.items() if k.startswith(("BLOCK", "ROWS"))}
            wgmma, tma = (("yes" if u[k] else "no") if arch >= 90 else "-" for k in ("wgmma", "tma"))
            print(f"{spec.name:<34} sm_{arch:<3} {u['regs']:>5} {u['stack']:>6} {u['local']:>6} "
                  f"{u['spill_stores']:>5}/{u['spill_loads']:<6} {u['shared']:>8} {wgmma:>6} {tma:>4}  {blocks} "
                  f"{spec.options}")


def logit_bytes(elem: int) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """{path: (before, after)}: DRAM bytes per element of the [rows, V] logits, by step, for inputs of `elem`
    bytes (the GEMM operand dtype). 'before' is the schedule of the previous release (fp32 d(raw) written in
    place, then a separate conversion pass to the operand dtype); 'after' writes d(raw) in the operand dtype."""
    cast = {} if elem == 4 else {"cast fp32->operand: read + write": 4 + elem}
    fwd = {"GEMM writes fp32 logits": 4, "row kernel reads (stats)": 4}
    bwd_before = {"GEMM writes fp32 logits": 4, "row kernel reads + writes fp32 d(raw)": 8, **cast,
                  "dh GEMM reads d(raw)": elem, "dW GEMM reads d(raw)": elem}
    bwd_after = {"GEMM writes fp32 logits": 4, "row kernel reads fp32, writes d(raw) in operand dtype": 4 + elem,
                 "dh GEMM reads d(raw)": elem, "dW GEMM reads d(raw)": elem}
    loss_before = {**fwd, **{k: v for k, v in bwd_before.items() if k != "GEMM writes fp32 logits"}}
    loss_after = {**fwd, **{k: v for k, v in bwd_after.items() if k != "GEMM writes fp32 logits"}}
    fused_bwd = {"tl.dot kernel writes d(raw) in operand dtype": elem, "dh GEMM reads d(raw)": elem,
                 "dW GEMM reads d(raw)": elem}
    fused_bwd_before = {"(fp32 atomics on dh and dW instead: per tile, not per element)": 0}
    return {
        "generic forward (workspace)": (fwd, fwd),
        "generic forward (fused tl.dot)": ({"logits stay in registers": 0}, {"logits stay in registers": 0}),
        "generic backward (workspace)": (bwd_before, bwd_after),
        "generic backward (fused tl.dot)": (fused_bwd_before, fused_bwd),
        "fused-loss (token-local, 6NDV)": (loss_before, loss_after),
    }


def model_report(n: int, d: int, v: int, elem: int = 2, chunk_rows: int = 441) -> None:
    print("\nBytes per element of the [rows, V] logits (bias adds one read of d(raw) for db)")
    for e in sorted({elem, 4}):
        for path, (before, after) in logit_bytes(e).items():
            print(f"  {'bf16/fp16' if e == 2 else 'fp32':<9} {path:<34} before {sum(before.values()):>3}   "
                  f"after {sum(after.values()):>3}   ({' + '.join(f'{k} {b}' for k, b in after.items())})")
    per = sum(logit_bytes(elem)["fused-loss (token-local, 6NDV)"][1].values())
    chunks = -(-n // chunk_rows)
    dw = (chunks - 1) * 8 * v * d + 4 * v * d + 6 * v * d if chunks > 1 else elem * v * d
    print(f"\nfused-loss at N={n} D={d} V={v}, {chunk_rows}-row chunks ({chunks}): logits {per * n * v / 1e9:.1f} GB, "
          f"dW {dw / 1e9:.1f} GB (first chunk beta=0 write, later read+write fp32, final cast; one chunk: "
          f"written once in the input dtype), dh {elem * n * d / 1e9:.2f} GB (written once in the input dtype)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=3, type=int, default=(8192, 4096, 151936), metavar=("N", "D", "V"))
    parser.add_argument("--chunk-rows", type=int, default=441, help="token rows per fused-loss chunk")
    parser.add_argument("--model-only", action="store_true", help="skip the AOT compile part")
    args = parser.parse_args()
    if not args.model_only:
        compile_report()
    model_report(*args.shape, chunk_rows=args.chunk_rows)


if __name__ == "__main__":
    main()
