"""Side-by-side CPU timing of the head in two source trees (e.g. a git worktree of an older commit and this one).

Rounds alternate the trees, each case in a fresh process per tree (`PYTHONPATH=<tree>`), so a load change on
a shared machine hits both alike; per case it prints the minimum over every timed run of each tree and the
ratio. Cases, forward + backward of one step (torch backend, default chunking, float32):

    generic       linear_logprobs with entropy, backward of sum(logprob) + 0.01 sum(entropy)
    fused         the fused-loss mode, token-local objective sum(lp) + 0.01 sum(H) (one pass, 6NDV)
    fused-coupled the same objective declared coupled (statistics pass, then gradients: 8NDV)

    .venv/bin/python bench/head_ab.py /tmp/base . --n 1024 --d 896 --v 32000 --rounds 3 --repeats 3

`--epilogue` times only the elementwise work around the GEMMs, in one process with both trees' modules loaded
side by side (`ops/torch_head.py`, `ops/fused_loss.py` of each tree, by file): on one [n, V] chunk of logits,
the generic statistics + gradient (`ChunkedHead.stats`, `grad_raw_`) and the fused-loss epilogue
(`_RowEpilogue.stats`, `grad_`, entropy on), alternating trees at every repeat (min over repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASE_CODE = r"""
import json, sys, time, torch
from ludic_fast.ops import linear_logprobs
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform

case, n, d, v, repeats = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
h = (torch.randn(n, d) * 0.05).requires_grad_()
w = (torch.randn(v, d) * 0.05).requires_grad_()
y = torch.randint(0, v, (n,))


def step():
    if case == "generic":
        out = linear_logprobs(h, w, y, backend="torch")
        loss = out.logprobs.sum() + 0.01 * out.entropy.sum()
    else:
        def objective(lp, ent, rows):
            return lp.sum() + 0.01 * ent.sum()
        plan = FusedPlan(HeadTransform.build(1.0, None, 1.0, n, h.device), objective, case == "fused-coupled", True)
        loss = fused_head_loss(h, w, None, y, plan)[0]
    loss.backward()
    h.grad = w.grad = None


step()  # warm-up
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def run_case(tree: str, case: str, args: argparse.Namespace) -> list[float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(
        [sys.executable, "-c", CASE_CODE, case, str(args.n), str(args.d), str(args.v), str(args.repeats)],
        env=env, cwd=os.path.abspath(tree), capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load(tree: str, rel: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(tree, rel))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def epilogue(args: argparse.Namespace) -> None:
    import time

    import torch

    torch.set_num_threads(args.threads)
    n, v = args.n, args.v
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(n, v, generator=g) * 3
    y = torch.randint(0, v, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    eye = torch.eye(v)[:2]  # placeholder weight: ChunkedHead needs one; the logits are z0
    trees = {}
    for label, tree in (("before", args.before), ("after", args.after)):
        th = _load(tree, "ludic_fast/ops/torch_head.py", f"torch_head_{label}")
        fl = _load(tree, "ludic_fast/ops/fused_loss.py", f"fused_loss_{label}")
        transform = th.HeadTransform.build(1.0, None, 1.0, n, "cpu")
        head = th.ChunkedHead(torch.zeros(n, 2), eye, None, y, transform, (n, v), -100)
        head.logits = lambda h_c, rows, cols: z0[rows, cols].clone()  # noqa: B023 (the chunk's final logits)
        trees[label] = (th, fl, head)

    def generic(label):
        th, _, head = trees[label]
        stats = head.stats(z0[:, :0], slice(0, n), True)  # h_c: only its device is read
        head.grad_raw_(z0.clone(), slice(0, n), slice(0, v), stats[0], stats[1], g_lp, g_h)

    def fused(label):
        th, fl, head = trees[label]
        z = z0.clone()
        try:
            epi = fl._RowEpilogue(z, y, "relative", head)
        except TypeError:  # the older signature
            epi = fl._RowEpilogue(z, y, keep_logits=True)
        stats = epi.stats()
        epi.grad_(stats[0], stats[1], g_lp, g_h, torch.ones(n))

    best = {}
    for case, fn in (("generic", generic), ("fused", fused)):
        for label in trees:
            fn(label)  # warm-up
        for _ in range(args.repeats * args.rounds):
            for label in trees:
                t0 = time.perf_counter()
                fn(label)
                best[case, label] = min(best.get((case, label), float("inf")), time.perf_counter() - t0)
    print(f"epilogue on one [{n}, {v}] float32 chunk, CPU, {args.threads} threads, "
          f"min of {args.rounds * args.repeats} runs per tree, trees alternating in one process")
    print(f"{'case':<14} {'before ms':>10} {'after ms':>10} {'after/before':>13}")
    for case in ("generic", "fused"):
        b, a = best[case, "before"], best[case, "after"]
        print(f"{case:<14} {1e3 * b:>10.1f} {1e3 * a:>10.1f} {a / b:>13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="source tree A (the baseline)")
    parser.add_argument("after", help="source tree B")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--d", type=int, default=896)
    parser.add_argument("--v", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="generic,fused,fused-coupled")
    parser.add_argument("--epilogue", action="store_true", help="time the epilogues only, in one process")
    args = parser.parse_args()
    if args.epilogue:
        return epilogue(args)
    cases = args.cases.split(",")
    best = {(c, t): float("inf") for c in cases for t in ("before", "after")}
    for _ in range(args.rounds):
        for case in cases:
            for label, tree in (("before", args.before), ("after", args.after)):
                best[case, label] = min(best[case, label], *run_case(tree, case, args))
    print(f"N={args.n} D={args.d} V={args.v} float32, CPU, {args.threads} threads, "
          f"min of {args.rounds} rounds x {args.repeats} runs, trees alternating")
    print(f"{'case':<14} {'before s':>9} {'after s':>9} {'after/before':>13}")
    for case in cases:
        b, a = best[case, "before"], best[case, "after"]
        print(f"{case:<14} {b:>9.3f} {a:>9.3f} {a / b:>13.3f}")


if __name__ == "__main__":
    main()
