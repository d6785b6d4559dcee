"""CISPO forward+backward on the LM head: ours (fused loss; 'ours_generic': the head op with autograd) vs
reference (materialised logits) vs Liger's chunked GRPO loss (loss_type='cispo') vs the three bare GEMMs
(the limit). Time and peak RSS, each implementation in its own process; ratios in one table.

    .venv/bin/python bench/cispo_quick.py                      # N=2048, D=896, V=151936, fp32, 2 threads
    .venv/bin/python bench/cispo_quick.py --impls ours gemms --chunks 16777216 33554432 67108864
    .venv/bin/python bench/cispo_quick.py --one ours --chunk 33554432   # one measurement, JSON on stdout

N action tokens = rows x (T-1): rows of T tokens whose first token is the prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

IMPLS = ("ours", "ours_generic", "reference", "liger", "gemms")


def _inputs(args):
    g = torch.Generator().manual_seed(0)
    rows, T = args.rows, args.tokens // args.rows + 1
    h = (torch.randn(rows, T, args.dim, generator=g) * 0.05).requires_grad_(True)
    W = (torch.randn(args.vocab, args.dim, generator=g) * 0.05).requires_grad_(True)
    ids = torch.randint(0, args.vocab, (rows, T), generator=g)
    am = torch.ones(rows, T)
    am[:, 0] = 0.0
    actor = (-12.0 + 0.3 * torch.randn(rows, T, generator=g)) * am
    batch = {"input_ids": ids, "action_mask": am, "weight": torch.randn(rows, generator=g), "actor_logps": actor}
    return batch, h, W


def _step(impl, batch, h, W, chunk):
    if impl in ("ours", "ours_generic"):  # fused loss (6NDV) or the head op with autograd (8NDV)
        from ludic_fast.losses import CISPOLoss

        loss, _ = CISPOLoss()(batch, hidden=h, weight=W, chunk_elements=chunk, fused=impl == "ours")
        loss.backward()
    elif impl == "reference":
        from ludic_fast import reference

        loss, _ = reference.CISPOLoss()(batch, logits=reference.head_logits(h, W))
        loss.backward()
    elif impl == "liger":
        from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss

        fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=False, use_ref_model=False, loss_type="cispo",
                                      epsilon_high=5.0)
        out = fn(h[:, :-1], W, batch["input_ids"][:, 1:], batch["action_mask"][:, 1:], batch["weight"],
                 old_per_token_logps=batch["actor_logps"][:, 1:])
        (out[0] if isinstance(out, tuple) else out).backward()
    else:  # the limit: logits, dh, dW as three plain GEMMs
        with torch.no_grad():
            x = h[:, :-1].reshape(-1, h.shape[-1])
            z = x @ W.T
            _ = z @ W
            _ = z.T @ x
    h.grad = W.grad = None


def measure_one(args) -> dict:
    torch.set_num_threads(args.threads)
    batch, h, W = _inputs(args)
    times, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        _step(args.one, batch, h, W, args.chunk)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"impl": args.one, "chunk": args.chunk, "median_s": statistics.median(times), "times_s": times,
            "cpu_s": statistics.median(cpu), "peak_rss_gib": rss_gib}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--dim", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--chunks", nargs="+", type=int, default=[None], help="chunk budgets (elements) for 'ours'")
    p.add_argument("--one", choices=IMPLS, help="run one implementation in this process, print JSON")
    p.add_argument("--chunk", type=int, default=None)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure_one(args)))
        return
    results = []
    for impl in args.impls:
        for chunk in args.chunks if impl.startswith("ours") else [None]:
            cmd = [sys.executable, __file__, "--one", impl, "--tokens", str(args.tokens), "--rows", str(args.rows),
                   "--dim", str(args.dim), "--vocab", str(args.vocab), "--threads", str(args.threads),
                   "--repeats", str(args.repeats)] + ([] if chunk is None else ["--chunk", str(chunk)])
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            if out.returncode != 0:
                print(f"{impl}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = {r["impl"]: r for r in results if r["impl"] in ("gemms", "reference")}
    print(f"N={args.tokens} D={args.dim} V={args.vocab} fp32 threads={args.threads} repeats={args.repeats} "
          f"load={os.getloadavg()[0]:.1f}")
    print("wall s: median wall-clock; cpu s: median process CPU time (all threads; steadier on a loaded machine)")
    print(f"{'impl':<10} {'chunk':>10} {'wall s':>7} {'cpu s':>7} {'peak GiB':>9} {'cpu/gemms':>9} {'cpu/ref':>8} "
          f"{'mem/ref':>8}")
    for r in results:
        g = base.get("gemms")
        ref = base.get("reference")
        g_c = f"{r['cpu_s'] / g['cpu_s']:.2f}" if g else "-"
        r_c = f"{r['cpu_s'] / ref['cpu_s']:.2f}" if ref else "-"
        r_m = f"{r['peak_rss_gib'] / ref['peak_rss_gib']:.2f}" if ref else "-"
        print(f"{r['impl']:<10} {str(r['chunk'] or 'default'):>10} {r['median_s']:>7.2f} {r['cpu_s']:>7.2f} "
              f"{r['peak_rss_gib']:>9.2f} {g_c:>9} {r_c:>8} {r_m:>8}")


if __name__ == "__main__":
    main()
