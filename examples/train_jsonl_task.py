"""RL on your own prompt/answer JSONL task with a Hugging Face model (GRPO-family preset, CPU or GPU).

    python examples/train_jsonl_task.py --model Qwen/Qwen2.5-0.5B-Instruct --task data/train.jsonl \\
        --reward numeric --preset dapo --rl-steps 200 --sampler vllm

A thin wrapper over `ludic-fast train` (same flags): rows are {"prompt": ..., "answer": ..., "id"?: ...};
rewards exact | numeric | format:<regex>; presets by name (grpo, dr_grpo, dapo, gspo, cispo, scalerl,
rl_zvp, reinforce, reinforce_baseline); `--sampler vllm` samples with vLLM on the GPU (weights synced after
every step); `--lora-r 16` trains LoRA adapters; `--checkpoint-every 50 --resume` for long runs.
"""

from __future__ import annotations

import sys

from ludic_fast.cli.train import main

if __name__ == "__main__":
    defaults = ["--sft-steps", "0", "--max-new-tokens", "256", "--max-seq-len", "1024", "--micro-token-budget",
                "8192", "--lr", "1e-6", "--prompts-per-batch", "16", "--group-size", "8", "--temperature", "1.0"]
    raise SystemExit(main(["train", *defaults, *sys.argv[1:]]))
