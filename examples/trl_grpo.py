"""GRPO with TRL 1.16, the loss from ludic_fast's fused head: swap `GRPOTrainer` for `FastGRPOTrainer`.

Runs on CPU in seconds: a tiny random Llama-architecture model built from a config, the built-in
character tokenizer and the addition task, TRL's own generation. The reward is graded so that a random
model's completions already differ within a group (GRPO's advantage r_i - mean(r) is 0 when they all tie,
as an exact-match reward alone would give a random model): 1 for the exact sum, else half the fraction of
digits in the completion. Every logged step shows a non-zero grad_norm (the loss value itself is near 0
on-policy: the advantages of a group have mean 0).

    .venv/bin/python examples/trl_grpo.py --steps 5 --loss-type cispo
"""

from __future__ import annotations

import argparse
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from ludic_fast.embedded import AdditionTask, build_char_tokenizer, build_tiny_model
from ludic_fast.integrations.trl import FastGRPOTrainer


def graded_sum_reward(completion: str, answer: str) -> float:
    """1 for the exact sum, else 0.5 x the fraction of the completion's characters that are digits."""
    text = completion.strip()
    if text == answer:
        return 1.0
    return 0.5 * sum(ch.isdigit() for ch in text) / max(len(text), 1)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train; returns TRL's log entries of the training steps (loss, reward, grad_norm, ...)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer))
    samples = AdditionTask(max_operand=20).samples("train", 64)
    answers = {s["prompt"]: s["answer"] for s in samples}

    def sum_reward(prompts, completions, **kwargs):
        return [graded_sum_reward(c, answers[p]) for p, c in zip(prompts, completions)]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=8, num_generations=8, max_completion_length=4,
            max_steps=args.steps, learning_rate=1e-3, loss_type=args.loss_type, entropy_coef=args.entropy_coef,
            use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[], logging_steps=1,
            save_strategy="no", seed=args.seed,
        )
        trainer = FastGRPOTrainer(
            model=model, reward_funcs=sum_reward, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"prompt": s["prompt"]} for s in samples]),
        )
        trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in steps:
        print({k: float(f"{entry[k]:.4g}") for k in ("loss", "reward", "reward_std", "grad_norm") if k in entry})
    return steps


if __name__ == "__main__":
    main()
