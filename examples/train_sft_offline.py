"""Offline SFT on chat-format JSONL ({"messages": [...]}) with the fused cross-entropy head, then save.

    python examples/train_sft_offline.py --model Qwen/Qwen2.5-0.5B --data chats.jsonl --steps 500 --out ckpt/

Items: the prompt is the chat template of all messages but the last (with the generation prompt), the
action the last assistant message; batches are shuffled with a seed per epoch and sharded across ranks
when torch.distributed is initialised. Checkpoints are atomic safetensors (`ludic_fast.run.checkpoint`).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ludic_fast.algorithm import make_sft
from ludic_fast.rollout import DatasetBatchSource
from ludic_fast.run.checkpoint import CheckpointConfig
from ludic_fast.run.loggers import PrintLogger
from ludic_fast.trainer import Trainer, TrainerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default="runs/sft")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    trainer = Trainer(
        model=model, algo=make_sft(length_normalize=True),
        batch_source=DatasetBatchSource.from_chat_jsonl(args.data, tok, batch_size=args.batch_size),
        cfg=TrainerConfig(pad_token_id=tok, lr=args.lr, sync_every_steps=0, lr_scheduler="cosine",
                          warmup_steps=max(1, args.steps // 20), total_steps=args.steps, gradient_checkpointing=True),
        checkpoint_config=CheckpointConfig(args.out, every_n_steps=max(1, args.steps // 10)),
        resume_from="latest" if args.resume else None,
        train_logger=PrintLogger(keys=["train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s"]),
    )
    trainer.train_sync(args.steps - trainer.step_idx)
    trainer.save_checkpoint()


if __name__ == "__main__":
    main()
