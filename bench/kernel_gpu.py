"""Kernel-level timings on a CUDA GPU (CUDA events, median of `--reps` after 2 warm-ups, bf16 inputs):

1. the fused tl.dot forward (`head_fwd` + `head_merge`) at each candidate launch configuration — the defaults
   of `kernels.head_fwd`, the measured-fast but spilling 128x256x64, and on sm_90 the TMA variant (descriptor
   loads, flattened vocab loop; opt-in, never timed before) — in ms and TFLOP/s (2NDV), next to the cuBLAS
   GEMM of the same logits (fp32 output);
2. the fused backward's gradient kernel (`head_grad`: logits recomputed, d(raw) written in bf16) on a
   [rows, V] block, default and (sm_90) TMA + persistent, in TFLOP/s of its 2·rows·D·V GEMM;
3. the row kernel on an fp32 [rows, V] workspace: statistics (reads 4 bytes per element) and the gradient
   written as bf16 over the workspace (reads 4, writes 2), as GB/s of those bytes, next to a device copy.

    python bench/kernel_gpu.py                              # N=8192 D=4096 V=151936
    python bench/kernel_gpu.py --shape 64 4096 151936 --rows 1024

With TRITON_INTERPRET=1 it also runs on the CPU (`--device cpu`, tiny shapes): a smoke test of the script,
whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from ludic_fast.kernels.head_fwd import launch_config, launch_head_fwd
from ludic_fast.kernels.head_grad import grad_config, launch_head_grad
from ludic_fast.kernels.head_merge import launch_head_merge
from ludic_fast.kernels.head_rows import launch_head_rows

from ludic_fast.ops.triton_head import fused_splits, new_workspace, operand_view

#: measured 17.3 ms (590 TFLOP/s) at N=8192 D=4096 V=151936 on an H100 with triton 3.6; spills (see docs)
WIDE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def timed(fn, reps: int, dev: torch.device) -> float:
    """Median milliseconds of fn() over `reps` runs after two warm-ups (CUDA events; wall clock off CUDA)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if dev.type != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _arch_and_programs(dev: torch.device) -> tuple[int, int]:
    if dev.type != "cuda":
        return 90, 4
    props = torch.cuda.get_device_properties(dev)
    return (90 if props.major >= 9 else 80), props.multi_processor_count


def fused_forward(n: int, d: int, v: int, reps: int, dev: torch.device) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, device=dev, generator=g) / d**0.5).to(torch.bfloat16)
    tgt = torch.randint(0, v, (n,), device=dev, generator=g, dtype=torch.int32)
    inv_t = torch.ones(n, device=dev)
    out = [torch.empty(n, device=dev) for _ in range(4)]
    flops = 2.0 * n * d * v
    arch, programs = _arch_and_programs(dev)
    ms = timed(lambda: torch.mm(h.float(), w.float().T) if dev.type != "cuda" else
               torch.mm(h, w.T, out_dtype=torch.float32), reps, dev)
    print(f"cuBLAS logits GEMM (fp32 out)              {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")
    configs = {"default": launch_config(2, arch, n), "128x256x64/8w/3s": WIDE}
    if launch_config(2, arch, n, tma=True).get("TMA"):
        configs["tma"] = launch_config(2, arch, n, tma=True)
    for name, config in configs.items():
        splits, per_split = fused_splits(n, v, config, programs)
        part = torch.empty(4, splits, n, device=dev)

        def run(config=config, per_split=per_split, part=part):
            launch_head_fwd(h, w, None, tgt, inv_t, part, per_split, scale=1.0, softcap=None, entropy=True,
                            upcast=dev.type != "cuda", precision="tf32", config=config)
            launch_head_merge(part, tgt, *out, entropy=True)

        ms = timed(run, reps, dev)
        blocks = "x".join(str(config[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        print(f"fused forward {name:<16} {blocks:<12} {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s "
              f"({splits} vocab splits)")


def grad_kernel(rows: int, d: int, v: int, reps: int, dev: torch.device) -> None:
    g = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(rows, d, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, device=dev, generator=g) / d**0.5).to(torch.bfloat16)
    tgt = torch.randint(0, v, (rows,), device=dev, generator=g, dtype=torch.int32)
    inv_t, ez = torch.ones(rows, device=dev), torch.zeros(rows, device=dev)
    lse, g_lp = torch.full((rows,), 12.0, device=dev), torch.randn(rows, device=dev, generator=g)
    out = new_workspace(rows, v, dev, torch.bfloat16)
    flops = 2.0 * rows * d * v
    arch, programs = _arch_and_programs(dev)
    configs = {"default": grad_config(2, arch)}
    if grad_config(2, arch, tma=True).get("TMA"):
        configs["tma+persistent"] = grad_config(2, arch, tma=True)
    for name, config in configs.items():

        def run(config=config):
            launch_head_grad(h, w, None, tgt, inv_t, lse, ez, g_lp, g_lp, out, col_start=0, scale=1.0, softcap=None,
                             upcast=dev.type != "cuda", precision="tf32", config=config, programs=programs)

        ms = timed(run, reps, dev)
        print(f"grad kernel {name:<18} {rows}x{v} block  {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")


def row_kernel(rows: int, v: int, reps: int, dev: torch.device) -> None:
    ws = new_workspace(rows, v, dev)
    ws.copy_(torch.randn(rows, v, device=dev))
    tgt = torch.randint(0, v, (rows,), device=dev, dtype=torch.int32)
    inv_t, g = torch.ones(rows, device=dev), torch.randn(rows, device=dev)
    lse, ez, zy = (torch.empty(rows, device=dev) for _ in range(3))
    d = operand_view(ws, torch.bfloat16)
    elems = rows * v
    copy_src, copy_dst = torch.empty(elems, device=dev), torch.empty(elems, device=dev)
    ms = timed(lambda: copy_dst.copy_(copy_src), reps, dev)
    print(f"device copy fp32 (read + write)            {ms:8.2f} ms  {8 * elems / ms / 1e6:6.0f} GB/s")

    def stats():
        launch_head_rows(ws, None, tgt, inv_t, lse, ez, zy, None, None, col_start=0, scale=1.0, softcap=None,
                         entropy=True, stats=True)

    ms = timed(stats, reps, dev)
    print(f"row kernel statistics (reads 4 B/elem)     {ms:8.2f} ms  {4 * elems / ms / 1e6:6.0f} GB/s")
    stats()

    def grad():  # reads the (overwritten) workspace as if it held logits: the traffic is what is timed
        launch_head_rows(ws, None, tgt, inv_t, lse, ez, None, g, g, col_start=0, scale=1.0, softcap=None,
                         entropy=True, stats=False, d=d)

    ms = timed(grad, reps, dev)
    print(f"row kernel gradient -> bf16 (4 + 2 B/elem) {ms:8.2f} ms  {6 * elems / ms / 1e6:6.0f} GB/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=3, type=int, default=(8192, 4096, 151936), metavar=("N", "D", "V"))
    parser.add_argument("--rows", type=int, default=2048,
                        help="rows of the gradient-kernel block and of the row-kernel workspace")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (smoke test)")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/kernel_gpu.py needs a CUDA GPU (the AOT report is bench/kernel_report.py)")
    print(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (interpreter)", f"torch {torch.__version__}")
    n, d, v = args.shape
    fused_forward(n, d, v, args.reps, dev)
    grad_kernel(args.rows, d, v, args.reps, dev)
    row_kernel(args.rows, v, args.reps, dev)


if __name__ == "__main__":
    main()
