"""Host time of one CISPO forward + backward on the triton path, its Triton kernel launches stubbed out: what
the Python glue, the loss objective and the dispatcher cost on the host, on any machine (no GPU needed; under
TRITON_INTERPRET=1 the triton backend runs on the CPU, and at this tiny shape the GEMMs cost microseconds).
On a GPU this host time is what the device waits for when a call's own device work is short (small N).

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 .venv/bin/python bench/host_time.py [--n 64 --d 16 --v 256 --runs 50]

Prints the median and minimum per step of the fused loss (`fused=True`) and of the generic path
(`fused=False`), alternated twice. The stubbed kernels leave lp, H and the gradients meaningless: a timing
tool only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="tokens per step (3/4 of them action rows)")
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--v", type=int, default=256)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise SystemExit("set TRITON_INTERPRET=1 (the triton backend on the CPU) or run on a CUDA machine")
    import ludic_fast.ops.triton_head as triton_head
    from ludic_fast.benchmark.workloads import Shape, make_inputs
    from ludic_fast.losses import CISPOLoss

    triton_head.launch_head_rows = lambda *a, **k: None  # the row kernel: host time only
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inp = make_inputs("cispo", Shape(args.n, args.d, args.v, "bfloat16"), device=device)
    h, w = (x.detach().requires_grad_() for x in (inp.hidden, inp.weight))
    loss_fn = CISPOLoss()

    def step(fused: bool) -> float:
        h.grad = w.grad = None
        t0 = time.perf_counter()
        loss, _ = loss_fn(inp.batch, hidden=h, weight=w, fused=fused, backend="triton")
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(2):
        for fused in (True, False):
            for _ in range(5):
                step(fused)
            times = [step(fused) for _ in range(args.runs)]
            print(f"fused={fused}: median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
