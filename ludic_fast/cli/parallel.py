"""`ludic-fast train --parallel {ddp,fsdp2}` under torchrun: the launch checks, the process group, the model's
wrapper and which rank writes.

    torchrun --nproc-per-node K -m ludic_fast.cli train --parallel ddp --output-dir runs/x ...

Every rank trains its share of each global batch (--sft-batch-size, --prompts-per-batch and --pref-batch-size
are global: multiples of K); rank 0 alone writes the run directory (metrics.jsonl, summary.json, curves.png,
the console), checkpoints are sharded (`run.sharded_checkpoint`, resumable on any K), and the run ends with a
plain Hugging Face export under <output-dir>/model. Under WORLD_SIZE > 1 without --parallel every rank would
train the whole run alone: refused.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ludic_fast.cli.presets import preset_names
from ludic_fast.cli.validation import UsageError
from ludic_fast.distributed.launch import PARALLEL_MODES, init_from_env, torchrun_env, wrap_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel (under torchrun)")
    g.add_argument("--parallel", default=None, choices=PARALLEL_MODES,
                   help="train on every torchrun rank: DDP, or FSDP2 (each decoder block sharded); "
                        "see docs/distributed.md")


def check_launch(args: argparse.Namespace) -> None:
    """The launch's one-line errors; sets `args.rank` and `args.world_size` (0 and 1 without --parallel)."""
    try:
        info = torchrun_env()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    world = 1 if info is None else info.world_size
    args.rank, args.world_size = 0, 1
    if args.parallel is None:
        if world > 1:
            raise UsageError(f"under torchrun (WORLD_SIZE={world}) pass --parallel ddp or --parallel fsdp2: without "
                             "it every rank would train the whole run on its own")
        return
    if info is None:
        raise UsageError("--parallel needs a torchrun launch (WORLD_SIZE is unset): "
                         "torchrun --nproc-per-node K -m ludic_fast.cli train --parallel ...")
    if args.output_dir is None:
        raise UsageError("--parallel needs --output-dir (every rank must name the same run directory)")
    if args.lora_r > 0:
        raise UsageError("--lora-r with --parallel: LoRA under DDP / FSDP2 is not supported by the command line")
    if getattr(args, "env", None):
        raise UsageError("--env with --parallel: multi-turn episodes are not shared across ranks yet; run on one rank")
    if args.engine != "hf":
        raise UsageError(f"--sampler {args.engine} with --parallel: only the in-process transformers sampler (hf) "
                         "samples on every rank")
    offline = args.preset in preset_names(offline=True)
    used = [("pref_batch_size", offline), ("sft_batch_size", not offline and args.sft_steps > 0),
            ("prompts_per_batch", not offline and args.rl_steps > 0)]
    for flag in [f for f, on in used if on]:
        value = getattr(args, flag)
        if value % world:
            raise UsageError(f"--{flag.replace('_', '-')} {value} is a global batch: it must be a multiple of the "
                             f"{world} ranks")
    dynamic = args.dynamic_sampling if args.dynamic_sampling is not None else args.preset == "dapo"
    if world > 1 and not offline and (dynamic or args.preset == "scalerl"):
        raise UsageError(f"--preset {args.preset}: dynamic sampling and ScaleRL's curriculum decide from every group "
                         "of a batch, which one rank does not see: run them on one rank (or --no-dynamic-sampling)")
    args.rank, args.world_size = info.rank, info.world_size


def start(args: argparse.Namespace) -> bool:
    """Join torchrun's process group under --parallel (`args.device` becomes the rank's); whether it did (the
    stop handler must then be `distributed.launch.AgreedStop`)."""
    if args.parallel is None:
        return False
    _, args.device = init_from_env(args.device)
    return True


def finish(args: argparse.Namespace) -> None:
    if args.parallel is not None and dist.is_initialized():
        dist.destroy_process_group()


def is_main(args: argparse.Namespace) -> bool:
    """Whether this process writes the run directory (rank 0, or the only process)."""
    return getattr(args, "rank", 0) == 0


def wrap(args: argparse.Namespace, model: torch.nn.Module, *, find_unused_parameters: bool = False
         ) -> torch.nn.Module:
    """The model under --parallel's wrapper (unchanged without --parallel)."""
    if getattr(args, "parallel", None) is None:
        return model
    return wrap_model(model, args.parallel, args.device, find_unused_parameters=find_unused_parameters)


__all__ = ["add_arguments", "check_launch", "start", "finish", "is_main", "wrap"]
