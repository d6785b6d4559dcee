"""GRPO with TRL 1.16, the loss from ludic_fast's fused head: swap `GRPOTrainer` for `FastGRPOTrainer`.

Runs on CPU in about a minute: a tiny random Llama-architecture model built from a config, the built-in
character tokenizer and the addition task (reward 1 for the exact sum), TRL's own generation.

    .venv/bin/python examples/trl_grpo.py --steps 5 --loss-type cispo
"""

from __future__ import annotations

import argparse
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from ludic_fast.embedded import AdditionTask, build_char_tokenizer, build_tiny_model
from ludic_fast.integrations.trl import FastGRPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    args = parser.parse_args()

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer))
    samples = AdditionTask(max_operand=20).samples("train", 64)
    answers = {s["prompt"]: s["answer"] for s in samples}

    def exact_sum(prompts, completions, **kwargs):
        return [float(c.strip() == answers[p]) for p, c in zip(prompts, completions)]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=8, num_generations=8, max_completion_length=4,
            max_steps=args.steps, learning_rate=1e-3, loss_type=args.loss_type, entropy_coef=args.entropy_coef,
            use_cpu=True, bf16=False, gradient_checkpointing=False, report_to=[], logging_steps=1,
            save_strategy="no",
        )
        trainer = FastGRPOTrainer(
            model=model, reward_funcs=exact_sum, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"prompt": s["prompt"]} for s in samples]),
        )
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({k: round(entry[k], 4) for k in ("loss", "reward", "entropy") if k in entry})


if __name__ == "__main__":
    main()
