"""Preference losses and distillation on the LM head, CPU: ours vs Liger-Kernel's chunked losses vs TRL's chunked
divergence vs the materialised reference. Forward + backward time (median of --repeats) and peak RSS, each
(workload, implementation) in its own process; one table with ratios to ours.

Workloads (N rows of hidden size D against V, fp32):
    dpo    P = N / (2 T) pairs of T tokens, sequences 2i / 2i+1 chosen / rejected, every position after the
           first scored; sigmoid DPO, β = 0.1, reference log-probs 0 (Liger: use_ref_model=False), so every
           implementation computes the same number.
    orpo   the same pairs; ORPO with the NLL term (λ = 0.1).
    jsd    N student rows against N teacher rows (D_t = --teacher-dim), generalised JSD β = 0.5, T = 1.

Implementations:
    ours          ludic_fast with no budget given (preference losses: one pass, 6NDV, when a pair fits 4 default
                  chunks, else two passes, 8NDV); jsd: linear_divergence, default budget
    ours_pair     preference losses with a chunk budget of one pair (2T x V): one pass, 6NDV; Liger's chunk size
    liger         LigerFusedLinearDPOLoss / LigerFusedLinearORPOLoss (chunk_size 1 pair, compiled=False on CPU);
                  jsd: LigerFusedLinearJSDLoss (the chunked torch version; LigerFusedLinearJSD is Triton-only)
    trl           jsd only: trl.kernels.chunked_divergence.ChunkedDivergenceFunction
    reference     ludic_fast.reference on materialised [N, V] logits

    .venv/bin/python bench/preference_bench.py                                 # N=2048 D=896 V=151936, 2 threads
    .venv/bin/python bench/preference_bench.py --n 64 --d 16 --v 101 --seq 16  # a smoke run
    .venv/bin/python bench/preference_bench.py --one dpo ours                  # one measurement, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

WORKLOADS = ("dpo", "orpo", "jsd")
IMPLS = {"dpo": ("ours", "ours_pair", "liger", "reference"), "orpo": ("ours", "ours_pair", "liger", "reference"),
         "jsd": ("ours", "liger", "trl", "reference")}
BETA_DPO, BETA_ORPO, BETA_JSD = 0.1, 0.1, 0.5


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def pair_inputs(args):
    """(batch, hidden [2P, T, D], weight [V, D], Liger's target [2P, T], Liger's row order)."""
    g = torch.Generator().manual_seed(0)
    rows = max(2, 2 * round(args.n / (2 * args.seq)))
    T = args.n // rows
    h = (torch.randn(rows, T, args.d, generator=g) * 0.05).requires_grad_(True)
    W = (torch.randn(args.v, args.d, generator=g) * 0.05).requires_grad_(True)
    ids = torch.randint(0, args.v, (rows, T), generator=g)
    am = torch.ones(rows, T)
    am[:, 0] = 0.0
    batch = {"input_ids": ids, "action_mask": am, "ref_seq_logps": torch.zeros(rows)}
    target = torch.full_like(ids, -100)
    target[:, :-1] = ids[:, 1:]
    order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])  # Liger: [chosen; rejected]
    return batch, h, W, target[order], order


def jsd_inputs(args):
    g = torch.Generator().manual_seed(0)
    hs = (torch.randn(args.n, args.d, generator=g) * 0.05).requires_grad_(True)
    Ws = (torch.randn(args.v, args.d, generator=g) * 0.05).requires_grad_(True)
    ht = torch.randn(args.n, args.teacher_dim, generator=g) * 0.05
    Wt = torch.randn(args.v, args.teacher_dim, generator=g) * 0.05
    return hs, Ws, ht, Wt


def _pair_step(workload, impl, args, inputs):
    from ludic_fast import preference
    from ludic_fast import reference as R

    batch, h, W, target, order = inputs
    loss_fn = preference.DPOLoss(beta=BETA_DPO) if workload == "dpo" else preference.ORPOLoss(beta=BETA_ORPO)
    if impl in ("ours", "ours_pair"):
        chunk = 2 * h.shape[1] * args.v if impl == "ours_pair" else None
        loss, _ = loss_fn(batch, hidden=h, weight=W, chunk_elements=chunk)
    elif impl == "reference":
        twin = R.DPOLoss(beta=BETA_DPO) if workload == "dpo" else R.ORPOLoss(beta=BETA_ORPO)
        loss, _ = twin(batch, logits=R.head_logits(h, W))
    else:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss, LigerFusedLinearORPOLoss

        if workload == "dpo":
            peer = LigerFusedLinearDPOLoss(beta=BETA_DPO, use_ref_model=False, compiled=False, chunk_size=1)
        else:
            peer = LigerFusedLinearORPOLoss(beta=BETA_ORPO, compiled=False, chunk_size=1)
        loss = peer(W, h[order], target)[0]
    loss.backward()
    return loss, (h.grad, W.grad)


def _jsd_step(impl, args, inputs):
    from ludic_fast import linear_divergence
    from ludic_fast import reference as R

    hs, Ws, ht, Wt = inputs
    if impl == "ours":
        loss = linear_divergence(hs, Ws, ht, Wt, kind="jsd", beta=BETA_JSD)
    elif impl == "reference":
        loss = R.linear_divergence(hs, Ws, ht, Wt, kind="jsd", beta=BETA_JSD)
    elif impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        peer = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA_JSD, compiled=False)
        loss = peer(hs, Ws, ht, Wt, torch.zeros(args.n, dtype=torch.long))
    else:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        loss = ChunkedDivergenceFunction.apply(hs, Ws, None, ht, Wt, None, BETA_JSD, 1.0)[0].mean()
    loss.backward()
    return loss, (hs.grad, Ws.grad)


def measure(workload: str, impl: str, args) -> dict:
    """One (workload, impl): loss, gradient norms, median time, peak RSS (this process)."""
    torch.set_num_threads(args.threads)
    inputs = jsd_inputs(args) if workload == "jsd" else pair_inputs(args)
    base = _rss_gib()
    times = []
    for _ in range(args.repeats):
        for t in (inputs[0], inputs[1]) if workload == "jsd" else (inputs[1], inputs[2]):
            t.grad = None
        t0 = time.perf_counter()
        loss, grads = _jsd_step(impl, args, inputs) if workload == "jsd" else _pair_step(workload, impl, args, inputs)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"workload": workload, "impl": impl, "loss": float(loss), "grad_norms": [float(g.norm()) for g in grads],
            "time_s": statistics.median(times), "peak_rss_gib": peak, "inputs_rss_gib": base}


def _run_one(workload, impl, args) -> dict:
    if args.inprocess:
        return measure(workload, impl, args)
    cmd = [sys.executable, __file__, "--one", workload, impl, *_shape_flags(args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"workload": workload, "impl": impl, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _shape_flags(args) -> list[str]:
    return ["--n", str(args.n), "--d", str(args.d), "--v", str(args.v), "--seq", str(args.seq), "--teacher-dim",
            str(args.teacher_dim), "--threads", str(args.threads), "--repeats", str(args.repeats)]


def table(rows: list[dict]) -> str:
    """Markdown: time, peak RSS, their ratios to ours, and the loss / gradient-norm agreement with ours."""
    out = ["| workload | impl | time s | peak RSS GiB | time / ours | RSS / ours | loss rel. diff | grad rel. diff |",
           "|---|---|---|---|---|---|---|---|"]
    ours = {r["workload"]: r for r in rows if r["impl"] == "ours" and "error" not in r}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['impl']} | error: {' '.join(r['error'])} | | | | | |")
            continue
        o = ours.get(r["workload"])
        if o is None:
            ratio_t = ratio_m = dl = dg = "-"
        else:
            ratio_t = f"{r['time_s'] / o['time_s']:.2f}"
            ratio_m = f"{r['peak_rss_gib'] / o['peak_rss_gib']:.2f}"
            dl = f"{abs(r['loss'] - o['loss']) / max(abs(o['loss']), 1e-12):.1e}"
            dg = f"{max(abs(a - b) / max(b, 1e-12) for a, b in zip(r['grad_norms'], o['grad_norms'])):.1e}"
        out.append(f"| {r['workload']} | {r['impl']} | {r['time_s']:.3f} | {r['peak_rss_gib']:.2f} | {ratio_t} | "
                   f"{ratio_m} | {dl} | {dg} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d", type=int, default=896)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (pair workloads)")
    p.add_argument("--teacher-dim", type=int, default=896)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--impls", nargs="+", default=None, help="default: every implementation of the workload")
    p.add_argument("--inprocess", action="store_true", help="measure in this process (tests; RSS then cumulative)")
    p.add_argument("--out", default=None, help="write the rows as JSON and the table as Markdown beside it")
    p.add_argument("--one", nargs=2, metavar=("WORKLOAD", "IMPL"), help="one measurement, JSON on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one, args)))
        return 0
    rows = []
    for w in args.workloads:
        for impl in IMPLS[w]:
            if args.impls is None or impl in args.impls:
                rows.append(_run_one(w, impl, args))
    md = table(rows)
    header = (f"N={args.n} D={args.d} V={args.v} seq={args.seq} D_teacher={args.teacher_dim} fp32, "
              f"{args.threads} threads")
    print(header + "\n\n" + md)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        Path(args.out).with_suffix(".md").write_text(header + "\n\n" + md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
