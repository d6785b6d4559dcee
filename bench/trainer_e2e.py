"""Trainer end to end: time and peak memory of one RL (CISPO) step of `ludic_fast.trainer.Trainer` on a small
Llama model with a large vocabulary, fused-loss head vs the reference loss path (model logits [B, T, V] +
`ludic_fast.reference.CISPOLoss`, as Ludic master computes it). Each path runs in its own process.

    .venv/bin/python bench/trainer_e2e.py                       # defaults: V=151936, D=256, 8 x 256 tokens
    .venv/bin/python bench/trainer_e2e.py --vocab 32000 --hidden 512 --seqs 16 --seq-len 512 --steps 3

Prints a markdown table (median / min step time, peak RSS, ratio fused / reference).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ludic_fast.benchmark.worker import RESULT_PREFIX, PeakMemory


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seqs", type=int, default=8, help="sequences per step (one micro-batch)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (a quarter is prompt)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=("fused", "reference"), help="run one path here (internal)")
    return p


def _batch(args: argparse.Namespace):
    from ludic_fast.types import ActorTokenLogps, SampleAttachments, SAWBatch, SAWItem

    g = torch.Generator().manual_seed(0)
    prompt = args.seq_len // 4
    items = []
    for i in range(args.seqs):
        ids = torch.randint(3, args.vocab, (args.seq_len,), generator=g).tolist()
        action = [0] * prompt + [1] * (args.seq_len - prompt)
        logps = (-torch.rand(args.seq_len - prompt, generator=g) * 12).tolist()
        items.append(SAWItem(ids, [1] * args.seq_len, action, weight=1.0 if i % 2 else -1.0,
                             meta={"rollout_id": str(i)}, attachments=SampleAttachments(ActorTokenLogps(logps))))
    return SAWBatch(items)


class _FixedSource:
    def __init__(self, batch):
        self.batch = batch

    async def next_batch(self):
        return copy.deepcopy(self.batch)


def _trainer(args: argparse.Namespace):
    from ludic_fast import reference
    from ludic_fast.algorithm import make_cispo
    from ludic_fast.embedded.model import build_tiny_model
    from ludic_fast.trainer import Trainer, TrainerConfig

    class ReferencePathTrainer(Trainer):
        """The micro-batch loss through the model's logits and the reference (Ludic master's) CISPOLoss."""

        def micro_loss(self, batch):
            logits = self.model(**self._model_inputs(batch)).logits
            return reference.CISPOLoss()(batch, logits=logits)

    model = build_tiny_model(args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                             num_hidden_layers=args.layers, max_position_embeddings=args.seq_len)
    tokens = args.seqs * args.seq_len
    cfg = TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=args.seq_len,
                        micro_token_budget=tokens)
    cls = Trainer if args.mode == "fused" else ReferencePathTrainer
    return cls(model=model, algo=make_cispo(group_size=2), batch_source=_FixedSource(_batch(args)), cfg=cfg)


def _child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    trainer = _trainer(args)
    memory = PeakMemory("cpu")
    memory.reset()
    trainer.train_step_sync()  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step_sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "peak_bytes": memory.peak(),
            "base_bytes": memory.base}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode:
        print(RESULT_PREFIX + json.dumps(_child(args)), flush=True)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    passthrough = list(argv if argv is not None else sys.argv[1:])
    rows = {}
    for mode in ("fused", "reference"):
        proc = subprocess.run([sys.executable, __file__, *passthrough, "--mode", mode], capture_output=True,
                              text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
        if line is None:
            raise SystemExit(f"{mode} failed: {proc.stderr.strip()[-800:]}")
        rows[mode] = json.loads(line[len(RESULT_PREFIX):])
    print(f"CISPO step, tiny Llama ({args.layers} layers, D={args.hidden}, V={args.vocab}), "
          f"{args.seqs} x {args.seq_len} tokens, {args.threads} threads, 1 warm-up + {args.steps} steps\n")
    print("| loss path | median step s | min step s | peak RSS GiB |\n|---|---|---|---|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['peak_bytes'] / 2**30:.2f} |")
    f, ref = rows["fused"], rows["reference"]
    print(f"| fused / reference | {f['median_s'] / ref['median_s']:.2f} | {f['min_s'] / ref['min_s']:.2f} "
          f"| {f['peak_bytes'] / ref['peak_bytes']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
