"""Data-parallel `ludic-fast train` on the CPU: step time and throughput of K ranks on one global batch, and
checkpoint write / load time, sharded (torch.distributed.checkpoint) vs the whole-model safetensors file.

    python bench/distributed_cli.py --out bench/results/distributed       (docs/distributed.md quotes it)

1. `python -m torch.distributed.run --nproc-per-node K -m ludic_fast.cli train --preset dpo --parallel MODE` (torchrun
   itself) for K = 1, 2 on the same global batch; the step time is the median of `perf/step_time_s` over the
   steps after the first (the ranks' mean), throughput = pairs per step / step time.
2. A tiny Llama of --ckpt-hidden width with AdamW state after one step: `run.checkpoint.CheckpointManager` (one
   process, whole files) against `run.sharded_checkpoint.ShardedCheckpointManager` on 1 and 2 FSDP2 ranks
   (forked gloo group); the median of --repeats saves and loads each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ludic_fast.distributed.launch import wrap_model
from ludic_fast.distributed.local import run_local_group
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager
from ludic_fast.run.loggers import read_jsonl
from ludic_fast.run.sharded_checkpoint import ShardedCheckpointManager


def step_times(ranks: int, mode: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(29500 + ranks), "-m", "ludic_fast.cli", "train", "--preset", "dpo", "--parallel", mode,
           "--offline-steps", str(args.steps), "--pref-batch-size", str(args.batch), "--logger", "none",
           "--no-plot", "--threads", "1", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    times = [r["perf/step_time_s"] for r in read_jsonl(out / "metrics.jsonl")][1:]
    step = statistics.median(times)
    return {"ranks": ranks, "mode": mode, "global_batch_pairs": args.batch, "steps": args.steps,
            "step_time_s": step, "pairs_per_s": args.batch / step, "wall_s": wall, "command": " ".join(cmd[1:])}


def _model(hidden: int):
    tok = build_char_tokenizer()
    return build_tiny_model(len(tok), seed=0, hidden_size=hidden, intermediate_size=4 * hidden,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)


def _stepped(model) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(2, 18).reshape(2, 8)).logits.square().mean().backward()
    opt.step()
    return opt


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sharded_worker(rank: int, world: int, hidden: int, repeats: int, root: str) -> None:
    torch.set_num_threads(1)
    model = wrap_model(_model(hidden), "fsdp2", "cpu")
    opt = _stepped(model)
    mgr = ShardedCheckpointManager(CheckpointConfig(root, max_to_keep=1))
    save = _timed(lambda: mgr.save(model, opt, step=1), repeats)
    load = _timed(lambda: mgr.load(model, opt), repeats)
    if rank == 0:
        Path(root, "timing.json").write_text(json.dumps({"save_s": save, "load_s": load}))


def checkpoint_times(hidden: int, repeats: int) -> list[dict]:
    rows = []
    model = _model(hidden)
    n_params = sum(p.numel() for p in model.parameters())
    opt = _stepped(model)
    with tempfile.TemporaryDirectory() as tmp:
        mgr = CheckpointManager(CheckpointConfig(tmp, max_to_keep=1))
        save = _timed(lambda: mgr.save(model, opt, step=1), repeats)
        load = _timed(lambda: mgr.load(model, opt), repeats)
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
        rows.append({"format": "whole (safetensors, 1 process)", "ranks": 1, "save_s": save, "load_s": load,
                     "bytes": size})
    for ranks in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            run_local_group(_sharded_worker, ranks, hidden, repeats, tmp, start_method="fork")
            timing = json.loads(Path(tmp, "timing.json").read_text())
            size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file() and f.name != "timing.json")
            rows.append({"format": "sharded (DCP, FSDP2)", "ranks": ranks, **timing, "bytes": size})
    for r in rows:
        r["params"] = n_params
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/distributed")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="global batch (preference pairs per step)")
    p.add_argument("--ckpt-hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("ddp", "fsdp2"):
            for ranks in (1, 2):
                steps.append(step_times(ranks, mode, args, Path(tmp) / f"{mode}{ranks}"))
                print(steps[-1], flush=True)
    ckpt = checkpoint_times(args.ckpt_hidden, args.repeats)
    for row in ckpt:
        print(row, flush=True)
    meta = {"machine": f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load average "
                       f"{os.getloadavg()[0]:.1f} at the end",
            "torch": torch.__version__, "command": "python bench/distributed_cli.py " + " ".join(sys.argv[1:])}
    (out / "results.json").write_text(json.dumps({"meta": meta, "steps": steps, "checkpoints": ckpt}, indent=1))
    lines = [f"# Data-parallel CLI on {meta['machine']}, torch {meta['torch']}", "", f"`{meta['command']}`", "",
             "| mode | ranks | global batch | step time (s) | pairs/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['ranks']} | {r['global_batch_pairs']} | {r['step_time_s']:.3f} | "
              f"{r['pairs_per_s']:.1f} |" for r in steps]
    lines += ["", f"Checkpoint of a {ckpt[0]['params'] / 1e6:.1f} M-parameter model with AdamW state (median of "
              f"{args.repeats})", "", "| format | ranks | write (s) | load (s) | MB on disk |", "|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['ranks']} | {r['save_s']:.3f} | {r['load_s']:.3f} | {r['bytes'] / 1e6:.1f} |"
              for r in ckpt]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
