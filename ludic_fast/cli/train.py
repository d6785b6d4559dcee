"""`ludic-fast train` and `ludic-fast demo`: `main` parses the flags (`cli.train_parser`, whose docstring is the
command's --help: defaults, outputs, resume, stopping), checks every input (`cli.train_task.prepare`), then runs
the SFT warm-up and RL (`cli.train_phases`) and writes the summary (`cli.train_summary`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from ludic_fast.cli import env_train, parallel
from ludic_fast.cli.dataset_presets import main as offline_main
from ludic_fast.cli.preset_flags import check_flag_scope
from ludic_fast.cli.presets import PRESETS as PRESET_RECORDS
from ludic_fast.cli.recipe import apply_recipe
from ludic_fast.cli.run_config import parse_with_config, record_run
from ludic_fast.cli.run_setup import (
    build_console_logger,
    build_model_and_tokenizer,
    check_resume,
    checkpoint_config,
    close_loggers,
    default_output_dir,
    stopped_line,
    trainer_config,
)
from ludic_fast.cli.train_parser import build_parser, samplers_epilog
from ludic_fast.cli.train_phases import (
    VLLM_DTYPES,
    build_engine,
    build_rollout_source,
    build_sampler,
    make_algorithm,
    run_rl,
    run_sft,
    vllm_model_dir,
)
from ludic_fast.cli.train_summary import summarize, summary_line, write_summary
from ludic_fast.cli.train_task import (
    RG_PREFIX,
    build_task,
    describe_eval,
    eval_on_train,
    prepare,
    reasoning_gym_cli_task,
)
from ludic_fast.cli.validation import UsageError, check_output_dir
from ludic_fast.distributed.launch import AgreedStop
from ludic_fast.engine.guard import EmptyBatchError, NonFiniteError
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.rollout import PromptAnswerTask
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager
from ludic_fast.run.loggers import JSONLLogger, TeeLogger, WandbLogger, keep_records_for_resume, read_jsonl
from ludic_fast.run.sharded_checkpoint import export_hf
from ludic_fast.run.warnings import LearningSignalMonitor, console_notifier

#: the RL presets' records by name (every preset, RL and offline: `cli.presets.PRESETS`)
PRESETS = {p.name: p for p in PRESET_RECORDS if not p.offline}


#: metrics that only mean something for rollouts, left out of the SFT phase's records
RL_ONLY_KEYS = ("train/avg_total_reward", "train/target_rollouts", "train/effective_rollouts")


def _header(args: argparse.Namespace, command: str, task: PromptAnswerTask | None) -> str:
    model = "embedded (tiny Llama, random init)" if args.model == "embedded" else args.model
    if task is None:
        evals = "greedy episodes of 64 fixed seeds" if args.eval_every > 0 else "none"
        what = (f"env {args.env} (episodes of up to {args.max_turns or 'the env`s'} turns, "
                f"{args.max_episode_tokens} tokens); eval: {evals}")
    else:
        what = f"task {task.name} ({len(task.samples)} training rows); eval: {describe_eval(args, task)}"
    return (
        f"ludic-fast {command}: model {model} on {args.device}; {what}; "
        f"prompts: {'chat template' if args.chat_template else 'raw text'}; "
        f"{args.sft_steps} SFT steps, then {args.rl_steps} RL steps of {args.preset}; output {args.output_dir}; "
        f"recipe: profile {args.profile}, dtype {args.dtype}, attn {args.attn}, layout {args.layout}"
    )


def _set_phase(console: Any, phase: str, total: int) -> None:
    if console is not None and hasattr(console, "set_phase"):
        console.set_phase(phase, total)


def main(argv: list[str]) -> int:
    """Entry point: argv[0] is "train" or "demo" (from `ludic_fast.cli`), the rest are flags. Returns 2
    after a one-line message on stderr when an input is bad (before anything is trained), 1 when training
    diverged (non-finite logits) or a batch left nothing to train (`engine.guard.EmptyBatchError`), 130 / 143
    when stopped by SIGINT / SIGTERM (module docstring)."""
    command, rest = (argv[0], argv[1:]) if argv else ("train", [])
    if command not in ("train", "demo"):
        raise ValueError(f"argv[0] must be 'train' or 'demo', got {command!r}")
    t0 = time.perf_counter()
    parser = build_parser(f"ludic-fast {command}")
    try:
        args = parse_with_config(parser, rest)
        parallel.check_launch(args)
        check_flag_scope(parser, args)
        env_train.check_env_args(parser, args)
    except UsageError as exc:
        print(f"ludic-fast {command}: error: {exc}", file=sys.stderr)
        return 2
    stop = AgreedStop() if parallel.start(args) else StopOnSignal()
    try:
        with stop:
            if PRESET_RECORDS[args.preset].offline:  # preference, reward-model and distillation presets: no rollouts
                return offline_main(args, command, stop, argv=[command, *rest], parser=parser)
            return _run(args, command, t0, stop, [command, *rest], parser)
    finally:
        parallel.finish(args)


def _run(args: argparse.Namespace, command: str, t0: float, stop: StopOnSignal, argv: list[str],
         parser: argparse.ArgumentParser) -> int:
    try:
        tok, task = prepare(args, command)
        args.output_dir = args.output_dir or default_output_dir(args, command)
        out = check_output_dir(args.output_dir, "--output-dir")
        resume_step = check_resume(args, ("rl", "sft"))
    except UsageError as exc:
        print(f"ludic-fast {command}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    metrics = out / "metrics.jsonl"
    main_rank = parallel.is_main(args)  # rank 0 writes the run directory
    rl_resume = args.resume and CheckpointManager(CheckpointConfig(str(out / "rl"))).latest_step() is not None
    if main_rank:  # the records past the checkpoint's step are logged again by the resumed run
        resumed = "rl" if rl_resume else "sft" if args.resume else None
        keep_records_for_resume(metrics, phases=("sft", "rl"), resumed=resumed, step=resume_step)
        if not rl_resume:  # RL starts anew: so does its episode log (a resumed source trims it itself)
            (out / env_train.EPISODE_LOG).unlink(missing_ok=True)
    if main_rank:
        record_run(out, parser, args, argv, objective=make_algorithm(args), trainer_configs={
            "sft": trainer_config(args, tok, lr=args.sft_lr, steps=args.sft_steps, sync=0),
            "rl": trainer_config(args, tok, lr=args.lr, steps=args.rl_steps, sync=1)})
        print(_header(args, command, task), flush=True)
    console = build_console_logger(args.logger if main_rank else "none", env_train.EPISODE_KEYS if args.env else ())
    monitor = LearningSignalMonitor(console_notifier(console))
    if args.rl_steps > 0 and args.group_size == 1 and PRESETS[args.preset].data == "groups":
        monitor.warn(
            "group_size",
            f"--group-size 1 with {args.preset}: a group of one has advantage 0, so the RL steps cannot learn",
        )
    wandb = WandbLogger(config=vars(args)) if args.wandb and main_rank else None
    model, tok = build_model_and_tokenizer(args, tok)
    model = parallel.wrap(args, model)
    trainer, error = None, None
    try:
        if args.sft_steps > 0 and not rl_resume:
            _set_phase(console, "sft", args.sft_steps)
            sft_logger = TeeLogger(
                JSONLLogger(metrics, extra={"phase": "sft"}), console, monitor, wandb, drop_keys=RL_ONLY_KEYS
            ) if main_rank else None
            model = run_sft(args, model, tok, task, sft_logger, stop=stop)
        if not stop.requested:
            _set_phase(console, "rl", args.rl_steps)
            rl_logger = TeeLogger(JSONLLogger(metrics, extra={"phase": "rl"}), console, monitor,
                                  wandb) if main_rank else None
            trainer = run_rl(args, model, tok, task, rl_logger, rl_resume, stop=stop)
    except (NonFiniteError, EmptyBatchError) as exc:  # one line; the records and checkpoints so far are kept
        error = exc
    finally:
        close_loggers(console, wandb)
    stopped = stop.requested  # read once here by every rank (under --parallel a collective)
    if error is None and args.parallel:  # every rank joins the gather; rank 0 writes
        export_hf(model if trainer is None else trainer.model, out / "model", tok)
    if not main_rank:
        return 1 if error is not None else stop.exit_code if stopped else 0
    summary = write_summary(args, command, out, t0, trainer)
    if error is not None:
        print(f"ludic-fast {command}: error: {error} (kept: {metrics}, summary.json, earlier checkpoints)",
              file=sys.stderr)
        return 1
    if stopped:
        phase = "rl" if trainer is not None else "sft"
        records = [r for r in read_jsonl(metrics) if r.get("phase") == phase] if metrics.exists() else []
        step = records[-1]["step"] if records else 0
        ckpt = None
        if args.checkpoint_every > 0:
            ckpt = CheckpointManager(CheckpointConfig(str(out / phase))).resolve()
        saved = ["metrics.jsonl", "summary.json"] + (["curves.png"] if "png" in summary else [])
        print(stopped_line(command, stop, phase, step, ckpt, saved), file=sys.stderr, flush=True)
        return stop.exit_code
    print("\n" + summary_line(summary))
    return 0


#: the command's entry point and, from the modules it was split into, the names that examples/, bench/ and
#: tests import from here (the same objects)
__all__ = [
    "main", "build_parser", "summarize", "summary_line", "prepare", "PRESETS", "RL_ONLY_KEYS",
    "samplers_epilog", "build_task", "eval_on_train", "reasoning_gym_cli_task", "describe_eval", "RG_PREFIX",
    "build_engine", "build_sampler", "vllm_model_dir", "VLLM_DTYPES", "run_sft", "make_algorithm",
    "build_rollout_source", "run_rl", "write_summary", "apply_recipe", "build_console_logger",
    "build_model_and_tokenizer", "check_resume", "checkpoint_config", "trainer_config",
]
