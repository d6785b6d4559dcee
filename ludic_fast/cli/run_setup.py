"""Building a `ludic-fast train` run from its parsed flags, for the RL and the offline presets alike: the
tokenizer and model, the console logger, the LoRA config, the engine's `TrainerConfig`, checkpoint settings,
the default output directory, the `--resume` check and the line a run stopped by a signal prints."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ludic_fast.cli.recipe import recipe_trainer_kwargs
from ludic_fast.cli.validation import UsageError
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager
from ludic_fast.run.loggers import PrintLogger, RichLiveLogger
from ludic_fast.trainer import TrainerConfig


def build_tokenizer(args: argparse.Namespace) -> Any:
    """The embedded character tokenizer (the demo's alphabet for the embedded task, printable ASCII for a JSONL
    task or an environment), or `--tokenizer` / `--model`'s from transformers."""
    if args.model == "embedded" and not args.tokenizer:
        from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, CHARACTERS, build_char_tokenizer

        demo = args.task == "embedded" and not getattr(args, "env", None)
        return build_char_tokenizer(CHARACTERS if demo else ASCII_CHARACTERS)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer or args.model)


def build_model_and_tokenizer(args: argparse.Namespace, tok: Any = None) -> tuple[torch.nn.Module, Any]:
    tok = build_tokenizer(args) if tok is None else tok
    if args.model == "embedded":
        from ludic_fast.embedded import build_tiny_model

        model = build_tiny_model(
            len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
            seed=args.seed,
            attn_implementation=args.attn,
            # episodes are longer than the demo's 64 positions (a rotary model: no parameter depends on it)
            **({"max_position_embeddings": max(64, args.max_episode_tokens)} if getattr(args, "env", None)
               else {"max_position_embeddings": max(64, args.max_seq_len or 64)}),
        )
        return model, tok
    from transformers import AutoModelForCausalLM

    # fp32 master weights under every --dtype: bf16/fp16 autocast the forward (train_recipe)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=args.attn)
    return model, tok


def build_console_logger(kind: str, extra_keys: tuple[str, ...] = ()) -> Any:
    """The console logger of --logger, showing the usual train keys and `extra_keys`."""
    if kind == "none":
        return None
    if kind == "rich" or (kind == "auto" and sys.stdout.isatty()):
        return RichLiveLogger(
            keys=[
                "train/loss",
                "train/avg_total_reward",
                "train/grad_norm",
                "train/skipped_steps",
                "train/lr",
                "train/ratio_mean",
                "train/clip_frac",
                "train/avg_completion_length",
                *extra_keys,
            ]
        )
    return PrintLogger(
        keys=[
            "train/loss",
            "train/avg_total_reward",
            "train/grad_norm",
            "train/skipped_steps",
            "eval/reward",
            "perf/step_time_s",
            *extra_keys,
        ],
        max_items_per_line=8,
    )


def close_loggers(*loggers: Any) -> None:
    """Close each logger that is given and has a `close` (the live dashboard, wandb)."""
    for lg in loggers:
        if lg is not None and hasattr(lg, "close"):
            lg.close()


def lora_config(args: argparse.Namespace) -> Any:
    if args.lora_r <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", lora_dropout=0.0)


def trainer_config(args: argparse.Namespace, tok: Any, *, lr: float, steps: int, sync: int) -> TrainerConfig:
    """The TrainerConfig of the parsed `ludic-fast train` flags for one phase (learning rate, step count,
    sync_every_steps); `tok` is the pad token id."""
    return TrainerConfig(
        model_device=args.device,
        lr=lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        max_seq_len=args.max_seq_len,
        micro_token_budget=args.micro_token_budget,
        sync_every_steps=sync,
        pad_token_id=tok,
        lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps,
        total_steps=max(steps, 1),
        gradient_checkpointing=args.gradient_checkpointing,
        memory_budget=args.memory_budget,
        max_lag=args.max_lag,
        reduce_stats_across_ranks=getattr(args, "parallel", None) is not None,
        **recipe_trainer_kwargs(args),
    )


def checkpoint_config(args: argparse.Namespace, phase: str) -> CheckpointConfig | None:
    if args.checkpoint_every <= 0 and not args.resume:
        return None
    return CheckpointConfig(
        str(Path(args.output_dir) / phase), every_n_steps=args.checkpoint_every, max_to_keep=args.max_to_keep
    )


def default_output_dir(args: argparse.Namespace, command: str) -> str:
    """runs/demo for `demo`; runs/<task>-<preset>-<YYYYmmdd-HHMMSS> for `train`."""
    if command == "demo":
        return "runs/demo"
    task = "addition" if args.task == "embedded" else Path(args.task.replace(":", "-").replace(",", "+")).stem
    return f"runs/{task}-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_resume(args: argparse.Namespace, phases: tuple[str, ...]) -> int | None:
    """With --resume, the step of the newest checkpoint under --output-dir/<phase> for the first phase that has
    one (a UsageError when none has); None without --resume."""
    if not args.resume:
        return None
    out = Path(args.output_dir)
    for phase in phases:
        step = CheckpointManager(CheckpointConfig(str(out / phase))).latest_step()
        if step is not None:
            return step
    where = " or ".join(f"{out / phase}" for phase in phases)
    raise UsageError(f"--resume: no checkpoint under {where} (was the run started with --checkpoint-every N?)")


def stopped_line(command: str, stop: StopOnSignal, phase: str, step: int, checkpoint: Path | None,
                 saved: list[str]) -> str:
    """The one line of a run stopped on request: what was saved and how to resume."""
    if checkpoint is not None:
        resume = f"checkpoint {checkpoint}; resume: the same `ludic-fast {command}` command with --resume"
    else:
        resume = "no checkpoint (--checkpoint-every 0): a rerun starts over"
    return f"stopped by {stop.signal_name} after {phase} step {step}: saved {', '.join(saved)}, {resume}"


__all__ = [
    "build_tokenizer",
    "build_model_and_tokenizer",
    "build_console_logger",
    "lora_config",
    "trainer_config",
    "checkpoint_config",
    "default_output_dir",
    "check_resume",
    "stopped_line",
]
