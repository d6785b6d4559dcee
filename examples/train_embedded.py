"""The embedded default, assembled by hand: SFT warm-up then CISPO RL on the built-in addition task (CPU).

    python examples/train_embedded.py --sft-steps 40 --rl-steps 80

This is what `ludic-fast demo` runs, written out with the library's pieces so each can be swapped:
the model (any transformers causal LM), the task (`PromptAnswerTask.from_jsonl`), the preset
(`ludic_fast.algorithm.make_*`), the engine (`HFSampler` or `VLLMSampler`), the loggers.
"""

from __future__ import annotations

import argparse

import torch

from ludic_fast.algorithm import make_cispo, make_sft
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.rollout import (
    DatasetBatchSource,
    Evaluator,
    HFSampler,
    RolloutBatchSource,
    SamplingConfig,
    embedded_default_task,
)
from ludic_fast.run.loggers import PrintLogger
from ludic_fast.run.stats import default_reducers
from ludic_fast.trainer import Trainer, TrainerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--rl-steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)

    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=args.seed)
    task = embedded_default_task(seed=args.seed)

    # 1. SFT warm-up: the answers as chat turns, masked cross-entropy on the assistant tokens
    chats = [{"messages": [{"role": "user", "content": s["prompt"]}, {"role": "assistant", "content": s["answer"]}]}
             for s in task.samples]
    sft = Trainer(
        model=model, algo=make_sft(length_normalize=True),
        batch_source=DatasetBatchSource.from_chat(chats, tok, batch_size=64, seed=args.seed),
        cfg=TrainerConfig(model_device="cpu", pad_token_id=tok, lr=3e-3, weight_decay=0.0, sync_every_steps=0,
                          max_seq_len=64, micro_token_budget=4096),
        train_logger=PrintLogger(prefix="[sft]", keys=["train/loss"]),
    )
    sft.train_sync(args.sft_steps)

    # 2. RL: groups of 8 samples per prompt, group-normalised advantages, CISPO loss on the fused head
    algo = make_cispo(group_size=8)
    engine = HFSampler(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=3)
    source = RolloutBatchSource(sampler=engine, task=task, tokenizer=tok, credit_assigner=algo.credit_assigner,
                                prompts_per_batch=32, group_size=8, sampling=sampling, seed=args.seed)
    evaluator = Evaluator(sampler=engine, task=task, tokenizer=tok,
                          sampling=SamplingConfig(temperature=0.0, max_new_tokens=3))
    rl = Trainer(
        model=model, algo=algo, batch_source=source, publisher=engine, evaluator=evaluator,
        cfg=TrainerConfig(model_device="cpu", pad_token_id=tok, lr=1e-3, weight_decay=0.0, temperature=1.0,
                          max_seq_len=64, micro_token_budget=4096, eval_every_n_steps=20, eval_at_start=True),
        train_logger=PrintLogger(prefix="[rl]", keys=["train/avg_total_reward", "train/loss", "eval/reward"]),
        reducers=default_reducers(),
    )
    rl.train_sync(args.rl_steps)


if __name__ == "__main__":
    main()
