"""`ludic-fast train`'s inputs: the task of --task / --eval-task (JSONL, embedded, reasoning_gym:) and
`prepare`, every input check before anything is built (a bad input raises UsageError, one line)."""

from __future__ import annotations

import argparse
from typing import Any

from ludic_fast.cli import env_train
from ludic_fast.cli.recipe import apply_recipe
from ludic_fast.cli.run_setup import build_tokenizer, trainer_config
from ludic_fast.cli.validation import UsageError, as_flags, check_args, check_device, check_task_tokens
from ludic_fast.rollout import PromptAnswerTask, embedded_default_task, resolve_chat_template
from ludic_fast.rollout.rewards import reward_from_specs


def eval_on_train(args: argparse.Namespace) -> bool:
    """--eval-on-train, defaulting to on for the embedded task and off for a JSONL task."""
    return args.eval_on_train if args.eval_on_train is not None else args.task == "embedded"


def build_task(args: argparse.Namespace) -> PromptAnswerTask:
    """The task with its eval rows (module docstring); a bad file or flag raises UsageError (one line)."""
    if args.eval_task and args.eval_on_train:
        raise UsageError("--eval-on-train and --eval-task exclude each other")
    if args.task.startswith(RG_PREFIX):
        return reasoning_gym_cli_task(args)
    if args.task_arg:
        raise UsageError(f"--task-arg applies to a {RG_PREFIX}NAME task")
    on_train = eval_on_train(args)
    reward = reward_from_specs(args.reward or ["exact"], args.reward_weights)
    if args.task == "embedded":
        if args.eval_task:
            raise UsageError("--eval-task needs a JSONL --task (the embedded task has its own eval split)")
        task = embedded_default_task(seed=args.seed, held_out_eval=not on_train)
        if args.reward is None:
            return task
        return PromptAnswerTask(task.samples, reward, name=task.name, eval_samples=task.eval_samples)
    try:
        task = PromptAnswerTask.from_jsonl(args.task, reward=reward, eval_path=args.eval_task)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.eval_task or args.eval_every <= 0:
        return task
    if on_train:
        return PromptAnswerTask(task.samples, task.reward_fn, name=task.name, eval_samples=list(task.samples))
    try:
        return task.hold_out(args.eval_holdout, seed=0)  # a split fixed by the file, the same for every --seed
    except ValueError:
        raise UsageError(
            f"--task {args.task} has {len(task.samples)} row(s), too few to hold out an eval set; "
            "pass --eval-task FILE or --eval-on-train"
        ) from None


RG_PREFIX = "reasoning_gym:"


def reasoning_gym_cli_task(args: argparse.Namespace) -> PromptAnswerTask:
    """--task reasoning_gym:NAME with its --task-arg options (dataset seed 0 unless given; eval from disjoint seeds)."""
    for flag in ("eval_task", "reward", "eval_on_train"):
        if getattr(args, flag) not in (None, False):
            raise UsageError(f"--{flag.replace('_', '-')} does not apply to a {RG_PREFIX} task (it is scored by "
                             "its own score_answer and evaluated on items of disjoint seeds)")
    from ludic_fast.agents.libraries.reasoning_gym import reasoning_gym_task

    try:
        return reasoning_gym_task(args.task[len(RG_PREFIX):], **{k: env_train._typed(v) for k, v in args.task_arg})
    except (ImportError, TypeError, ValueError) as exc:
        raise UsageError(f"--task {args.task}: {exc}") from None


def describe_eval(args: argparse.Namespace, task: PromptAnswerTask) -> str:
    """Which rows the evaluation uses, for the run header."""
    if args.eval_every <= 0:
        return "none (--eval-every 0)"
    n = len(task.eval_samples or task.samples)
    if args.eval_task:
        return f"{n} rows of {args.eval_task}"
    if eval_on_train(args):
        return f"the {n} training rows (--eval-on-train)"
    return f"{n} rows held out of the task ({'--eval-holdout' if args.task != 'embedded' else 'held-out sums'})"



def prepare(args: argparse.Namespace, command: str) -> tuple[Any, PromptAnswerTask]:
    """Every input check (raises UsageError): flags, files, device, extras, models, then the task's rows
    against the tokenizer. Returns the tokenizer and the task; nothing is trained or written yet."""
    if command == "demo" and (args.model != "embedded" or args.task != "embedded"):
        raise UsageError("demo runs the embedded default; use `ludic-fast train` for --model/--task")
    if args.resume and args.output_dir is None:
        raise UsageError("--resume needs --output-dir (the run to continue)")
    if args.sft_data and args.chat_template is False:
        raise UsageError("--sft-data is chat JSONL, formatted by the chat template: drop --no-chat-template")
    check_device(args.device)
    if args.env and args.max_seq_len is None:  # an episode is trained whole (the profile's default is a task's)
        args.max_seq_len = args.max_episode_tokens
    if args.task.startswith(RG_PREFIX) and args.max_seq_len is None:  # its prompts are longer than the demo's
        args.max_seq_len = 1024
    apply_recipe(args)
    check_args(args)
    if args.env:
        env_train.env_factory(args)
        env_train.env_rewards(args)
    task = None if args.env else build_task(args)
    try:
        tok = build_tokenizer(args)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        source = args.tokenizer or args.model
        raise UsageError(f"--tokenizer/--model: cannot load a tokenizer from {source}: {reason}") from None
    try:
        args.chat_template = resolve_chat_template(tok, args.chat_template)
    except ValueError:
        raise UsageError("--chat-template: the tokenizer has no chat template") from None
    if task is not None:
        check_task_tokens(task.samples + task.eval_samples, tok,
                          embedded=args.model == "embedded" and not args.tokenizer)
    for lr, steps, sync in ((args.sft_lr, args.sft_steps, 0), (args.lr, args.rl_steps, 1)):
        try:  # the trainer's own cross-field checks, before anything runs
            trainer_config(args, tok, lr=lr, steps=steps, sync=sync)
        except ValueError as exc:
            raise UsageError(as_flags(str(exc), args)) from None
    return tok, task

