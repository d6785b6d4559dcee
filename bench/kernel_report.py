"""Compile every ludic_fast Triton kernel ahead of time for sm_80 and sm_90 (no GPU needed) and print one
line per kernel x architecture: registers, stack, local memory and spill bytes, shared memory, wgmma.

    .venv/bin/python bench/kernel_report.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 = its current default

from ludic_fast.kernels.aot import ARCHS, SPECS, compile_spec, resource_usage  # noqa: E402


def main() -> None:
    print(f"{'kernel':<12} {'arch':<6} {'regs':>5} {'stack':>6} {'local':>6} {'spill st/ld':>12} "
          f"{'shared':>8} {'wgmma':>6}  config")
    for spec in SPECS:
        for arch in ARCHS:
            u = resource_usage(compile_spec(spec, arch), arch)
            blocks = {k: v for k, v in spec.constexprs.items() if k.startswith(("BLOCK", "ROWS"))}
            wgmma = ("yes" if u["wgmma"] else "no") if arch >= 90 else "-"
            print(f"{spec.name:<12} sm_{arch:<3} {u['regs']:>5} {u['stack']:>6} {u['local']:>6} "
                  f"{u['spill_stores']:>5}/{u['spill_loads']:<6} {u['shared']:>8} {wgmma:>6}  {blocks} {spec.options}")


if __name__ == "__main__":
    main()
