"""`ludic-fast train` and `ludic-fast demo`: a short SFT warm-up, then RL with a preset, then a summary.

Defaults are the embedded default (`demo` is `train` with them): the tiny Llama of `ludic_fast.embedded`
(random init from a config, no download), its character tokenizer and the built-in addition task, on
CPU; SFT (masked CE) on the task's train answers, then RL with the CISPO preset on groups sampled by
transformers `generate`. Prompts take one format in SFT, rollouts and evaluation: the tokenizer's chat
template when it has one (`--no-chat-template`: the raw prompt text). Evaluation: `--eval-task`, else for
a JSONL task `--eval-holdout` of its rows held out of training (`--eval-on-train` evaluates on the
training rows instead); the embedded task evaluates on its training sums by default (single-digit sums
are facts to memorise; `--no-eval-on-train` uses its held-out sums). All inputs are checked before
anything is built: a bad one is a one-line error and exit status 2.

Outputs under `--output-dir` (default: runs/demo for `demo`, runs/<task>-<preset>-<time> for `train`):
config.yaml (every setting, as resolved: `--config` re-runs it), run.json (command line, settings, versions,
commit, machine), metrics.jsonl (every logged step, with `phase`), curves.png (reward and loss), summary.json (the RL
reward curve's first/last-10 means), checkpoints under sft/ and rl/ when `--checkpoint-every` > 0.
`--resume` continues from the latest checkpoint: the RL phase from rl/'s (the SFT phase is then
skipped), else the SFT phase from sft/'s; the records past that checkpoint's step are dropped from
metrics.jsonl (the resumed run logs them again), so a stopped-then-resumed run's files equal an
uninterrupted run's. `--resume` without a checkpoint there is an error.

Stopping: the first SIGINT (Ctrl-C) or SIGTERM finishes the current optimizer step, writes a checkpoint
when `--checkpoint-every` > 0, the summary and the curves, prints one line saying what was saved and how to
resume, and exits 130 (SIGINT) or 143 (SIGTERM); a second SIGINT ends at once. A run whose loss stays
non-finite (or whose rollouts sample from inf/nan probabilities) stops with one line naming the step and
the likely cause, exit 1, keeping everything written so far.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ludic_fast import algorithm as presets
from ludic_fast.cli import env_train, parallel
from ludic_fast.cli.dataset_presets import add_arguments as add_offline_arguments
from ludic_fast.cli.dataset_presets import main as offline_main
from ludic_fast.cli.preset_builders import BuildInputs
from ludic_fast.cli.preset_flags import check_flag_scope
from ludic_fast.cli.presets import PRESETS as PRESET_RECORDS
from ludic_fast.cli.presets import presets_epilog
from ludic_fast.cli.recipe import add_recipe_arguments, apply_recipe, profile_default_help
from ludic_fast.cli.run_config import parse_with_config, record_run
from ludic_fast.cli.run_setup import (
    build_console_logger,
    build_model_and_tokenizer,
    build_tokenizer,
    check_resume,
    checkpoint_config,
    close_loggers,
    default_output_dir,
    lora_config,
    stopped_line,
    trainer_config,
)
from ludic_fast.cli.validation import (
    OneLineParser,
    UsageError,
    as_flags,
    check_args,
    check_device,
    check_output_dir,
    check_task_tokens,
    comma_numbers,
)
from ludic_fast.distributed.launch import AgreedStop, EngineVersion, RankShareSource, unwrap
from ludic_fast.engine.guard import NonFiniteError
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.ops.budget import parse_memory_budget
from ludic_fast.rollout import (
    DatasetBatchSource,
    Evaluator,
    PromptAnswerTask,
    RolloutBatchSource,
    SamplingConfig,
    embedded_default_task,
    resolve_chat_template,
    sft_item,
)
from ludic_fast.rollout.rewards import reward_from_specs
from ludic_fast.rollout.sampler import SAMPLERS, Sampler, SamplerSettings
from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager
from ludic_fast.run.loggers import (
    JSONLLogger,
    TeeLogger,
    WandbLogger,
    keep_records_for_resume,
    plot_curves,
    read_jsonl,
)
from ludic_fast.run.sharded_checkpoint import export_hf
from ludic_fast.run.stats import default_reducers
from ludic_fast.run.warnings import LearningSignalMonitor, console_notifier
from ludic_fast.trainer import Trainer

#: the RL presets' records by name (every preset, RL and offline: `cli.presets.PRESETS`)
PRESETS = {p.name: p for p in PRESET_RECORDS if not p.offline}


#: metrics that only mean something for rollouts, left out of the SFT phase's records
RL_ONLY_KEYS = ("train/avg_total_reward", "train/target_rollouts", "train/effective_rollouts")


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                      epilog=f"{presets_epilog()}\n\n{samplers_epilog()}")
    g = p.add_argument_group("model and task")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="settings from a YAML or TOML file (flag names as keys; a run's saved config.yaml re-runs "
                        "it); flags given beside it override it")
    g.add_argument("--model", default="embedded", help="'embedded' (tiny Llama from a config) or a HF name/path")
    g.add_argument("--tokenizer", default=None, help="HF tokenizer name/path (default: the model's, or embedded)")
    g.add_argument("--task", default="embedded",
                   help="'embedded' (addition), a JSONL file of prompt/answer rows, or reasoning_gym:NAME[,NAME...] "
                        "(reasoning-gym datasets scored by their own score_answer; docs/environments.md)")
    g.add_argument("--task-arg", type=env_train._key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="an option of a reasoning_gym: task (repeatable): seed, size, eval_seed, eval_size, "
                        "prompt=tags|plain, or the dataset's own options")
    g.add_argument("--eval-task", default=None, help="JSONL of eval rows (default: see --eval-holdout)")
    g.add_argument(
        "--eval-holdout",
        type=float,
        default=0.1,
        help="without --eval-task: this fraction of a JSONL task's rows is held out of training for evaluation",
    )
    g.add_argument(
        "--eval-on-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evaluate on the training rows (default: on for the embedded task, off for a JSONL task)",
    )
    g.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format prompts (SFT, rollouts, eval) with the tokenizer's chat template (default: when it has one)",
    )
    g.add_argument("--reward", action="append", default=None, metavar="SPEC",
                   help=f"a reward function (repeatable, summed with --reward-weights): "
                        f"{' | '.join(_reward_specs())} | module:function (default: exact)")
    g.add_argument("--reward-weights", type=comma_numbers, default=None, metavar="W1,W2,...",
                   help="one weight per --reward, comma-separated (TRL's reward_weights; default: 1 each)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave torch's default)")
    g = p.add_argument_group("SFT warm-up")
    g.add_argument("--sft-steps", type=int, default=40)
    g.add_argument("--sft-batch-size", type=int, default=64)
    g.add_argument("--sft-lr", type=float, default=None, help=profile_default_help("sft_lr"))
    g.add_argument(
        "--sft-data",
        default=None,
        help="chat JSONL ({'messages': [...]}, through the chat template); default: the task's answers",
    )
    g = p.add_argument_group("RL")
    g.add_argument("--preset", default="cispo", choices=PRESET_RECORDS.names(), help="what to train (list below)")
    g.add_argument("--rl-steps", type=int, default=80)
    g.add_argument("--prompts-per-batch", type=int, default=32)
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (0 = greedy); the losses score at the same one (greedy: 1)")
    g.add_argument("--max-new-tokens", type=int, default=None, help=profile_default_help("max_new_tokens"))
    g.add_argument(
        "--dynamic-sampling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DAPO dynamic sampling (default: on for dapo)",
    )
    g.add_argument("--max-rounds", type=int, default=4)
    g.add_argument("--tie-jitter", type=float, default=0.0)
    g.add_argument("--sampler", "--engine", dest="engine", default="hf", type=_sampler, action=_SamplerAction,
                   metavar="NAME",
                   help=f"what samples the rollouts: {', '.join(SAMPLERS.names())} (list below) or module:attr; "
                        "--engine is its deprecated old name")
    g.add_argument("--vllm-url", default=None,
                   help="--sampler vllm-server: the URL of a running server, or several joined by commas "
                        "(requests spread over them, weights pushed to all; default: the run starts one)")
    g.add_argument("--vllm-arg", type=_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="a vLLM engine argument (repeatable), e.g. max_num_batched_tokens=4096")
    g = p.add_argument_group("trainer")
    g.add_argument("--lr", type=float, default=None, help=profile_default_help("lr"))
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--lr-scheduler", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--max-seq-len", type=int, default=None, help=profile_default_help("max_seq_len"))
    g.add_argument("--micro-token-budget", type=int, default=None, help=profile_default_help("micro_token_budget"))
    g.add_argument("--gradient-checkpointing", action="store_true")
    g.add_argument("--memory-budget", type=_memory_budget, default=None,
                   help="bytes the LM head may hold beyond its inputs, e.g. 4GiB (default: the device's)")
    g.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0 = full fine-tuning; needs the [lora] extra)")
    g.add_argument("--max-lag", type=int, default=None)
    g.add_argument("--eval-every", type=int, default=20)
    g.add_argument("--output-dir", default=None, help="default: runs/demo (demo), runs/<task>-<preset>-<time> (train)")
    g.add_argument("--checkpoint-every", type=int, default=0)
    g.add_argument("--max-to-keep", type=int, default=2)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (rl/, else sft/)")
    g.add_argument("--logger", default="auto", choices=["auto", "rich", "print", "none"])
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases (needs the [wandb] extra)")
    g.add_argument("--no-plot", action="store_true")
    env_train.add_env_arguments(p)
    add_recipe_arguments(p)
    add_offline_arguments(p)
    parallel.add_arguments(p)
    return p


# ------------------------------------------------------------------------------------------- building
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


def build_engine(args: argparse.Namespace, model: torch.nn.Module, tok: Any) -> Sampler:
    """The rollout sampler of --sampler (`rollout.sampler.SAMPLERS`): transformers `generate` on the trainer's
    model, vLLM (in this process, or its server: started here, or --vllm-url's) serving --model (the embedded
    model: a copy saved under --output-dir) in --dtype with the --vllm-arg engine arguments, or a user's."""
    settings = SamplerSettings(model=unwrap(model), tokenizer=tok, seed=args.seed, dtype=VLLM_DTYPES[args.dtype],
                               model_path=lambda: vllm_model_dir(args, tok), tokenizer_path=args.tokenizer,
                               options=dict(args.vllm_arg), url=args.vllm_url)
    return SAMPLERS.resolve(args.engine).build(settings)


build_sampler = build_engine


def samplers_epilog() -> str:
    """The `--help` listing of the registered samplers."""
    width = max(len(e.name) for e in SAMPLERS)
    return "samplers (--sampler NAME):\n" + "\n".join(f"  {e.name:<{width}}  {e.help}" for e in SAMPLERS)


def _reward_specs() -> list[str]:
    from ludic_fast.rollout.rewards import REWARD_FUNCS

    return [f"{e.name}:<arg>" if e.takes_arg else e.name for e in REWARD_FUNCS]


def _sampler(text: str) -> str:
    if text not in SAMPLERS and ":" not in text:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(SAMPLERS.names())} "
                                         "or module:attr)")
    return text


class _SamplerAction(argparse.Action):
    """--sampler NAME; its old name --engine also gives a FutureWarning (shown to command-line users)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string == "--engine":
            import warnings

            warnings.warn("--engine is deprecated: use --sampler (the training engine is ludic_fast.engine)",
                          FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


#: vLLM's dtype names of the resolved --dtype
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_model_dir(args: argparse.Namespace, tok: Any) -> str:
    """--model; for the embedded model, its architecture and tokenizer saved to <output-dir>/vllm_model (a
    temporary folder without --output-dir): the trainer pushes its weights before the first RL batch."""
    if args.model != "embedded":
        return args.model
    path = Path(args.output_dir or tempfile.mkdtemp(prefix="ludic-fast-")) / "vllm_model"
    fresh, _ = build_model_and_tokenizer(args, tok)
    fresh.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _engine_arg(text: str) -> tuple[str, Any]:
    """KEY=VALUE of --vllm-arg; VALUE read as JSON when it parses (4096, true, 0.5), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. max_num_batched_tokens=4096), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _memory_budget(text: str) -> int:
    try:
        return parse_memory_budget(text, "--memory-budget")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run_sft(args: argparse.Namespace, model: torch.nn.Module, tok: Any, task: PromptAnswerTask, logger: Any,
            stop: StopOnSignal | None = None) -> Any:
    """SFT warm-up on --sft-data, else on the task's training answers in the rollouts' prompt format; returns
    the model (stopped early when `stop` is requested)."""
    if args.sft_data:
        source = DatasetBatchSource.from_chat_jsonl(args.sft_data, tok, batch_size=args.sft_batch_size, seed=args.seed,
                                                    rank=0, world_size=1)
    else:
        if args.env:
            items = env_train.demonstration_items(args, tok, env_train.env_factory(args))
        else:
            chat = resolve_chat_template(tok, args.chat_template)
            items = [sft_item(tok, s["prompt"], s["answer"], chat_template=chat) for s in task.samples]
        source = DatasetBatchSource(items, batch_size=args.sft_batch_size, seed=args.seed, rank=0, world_size=1)
    if getattr(args, "world_size", 1) > 1:  # the global batches, this rank's share of each
        source = RankShareSource(source, args.rank, args.world_size)
    ckpt = checkpoint_config(args, "sft")
    resume = args.resume and ckpt is not None and CheckpointManager(ckpt).resolve() is not None
    trainer = Trainer(
        model=model,
        algo=presets.make_sft(length_normalize=True),
        batch_source=source,
        cfg=trainer_config(args, tok, lr=args.sft_lr, steps=args.sft_steps, sync=0),
        checkpoint_config=ckpt,
        resume_from="latest" if resume else None,
        train_logger=logger,
        lora_config=lora_config(args),
    )
    print(f"sft: {trainer.memory_estimate.format()}", flush=True)
    trainer.train_sync(max(0, args.sft_steps - trainer.step_idx), stop=stop)
    return trainer.model


def make_algorithm(args: argparse.Namespace) -> Any:
    """The RL preset's algorithm (its record's build)."""
    return PRESET_RECORDS[args.preset].build(args, BuildInputs())


def build_rollout_source(args: argparse.Namespace, engine: Any, tok: Any, task: PromptAnswerTask, algo: Any
                         ) -> RolloutBatchSource:
    """The RL batches of the sampling flags (groups, temperature, DAPO dynamic sampling, tie jitter) and the
    preset's credit assigner and curriculum; `ludic-fast train` and the pipeline actor sample alike."""
    dynamic = args.dynamic_sampling if args.dynamic_sampling is not None else args.preset == "dapo"
    return RolloutBatchSource(
        sampler=engine,
        task=task,
        tokenizer=tok,
        credit_assigner=algo.credit_assigner,
        prompts_per_batch=args.prompts_per_batch,
        group_size=args.group_size,
        sampling=SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens),
        seed=args.seed,
        dynamic_sampling=dynamic,
        max_rounds=args.max_rounds,
        tie_jitter=args.tie_jitter,
        curriculum=algo.curriculum,
        chat_template=args.chat_template,
        rank=getattr(args, "rank", 0),
        world_size=getattr(args, "world_size", 1),
        per_group_seeds=getattr(args, "parallel", None) is not None,
    )


def run_rl(
    args: argparse.Namespace,
    model: torch.nn.Module,
    tok: Any,
    task: PromptAnswerTask,
    logger: Any,
    resume: bool,
    stop: StopOnSignal | None = None,
) -> Trainer:
    algo = make_algorithm(args)
    engine = build_engine(args, model, tok)
    if args.env:
        source = env_train.env_source(args, engine, tok, algo, Path(args.output_dir) if args.output_dir else None)
    else:
        source = build_rollout_source(args, engine, tok, task, algo)
    evaluator = None
    if args.eval_every > 0 and args.env:
        evaluator = env_train.env_evaluator(args, engine, tok)
    elif args.eval_every > 0:
        evaluator = Evaluator(
            sampler=engine,
            task=task,
            tokenizer=tok,
            sampling=SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens),
            chat_template=args.chat_template,
        )
    cfg = trainer_config(args, tok, lr=args.lr, steps=args.rl_steps, sync=1)
    cfg.eval_every_n_steps = args.eval_every if evaluator is not None else None
    cfg.eval_at_start = evaluator is not None and not resume
    trainer = Trainer(
        model=model,
        algo=algo,
        batch_source=source,
        cfg=cfg,
        publisher=EngineVersion(engine) if args.parallel else engine,
        evaluator=evaluator,
        checkpoint_config=checkpoint_config(args, "rl"),
        resume_from="latest" if resume else None,
        train_logger=logger,
        reducers=default_reducers(),
        lora_config=None if hasattr(model, "peft_config") else lora_config(args),  # SFT may have wrapped it
    )
    print(f"rl: {trainer.memory_estimate.format()}", flush=True)
    trainer.push_weights()  # the engine samples the first batch with the trained (SFT's) weights, not --model's
    trainer.train_sync(max(0, args.rl_steps - trainer.step_idx), stop=stop)
    return trainer


def summarize(records: list[dict[str, Any]], key: str = "train/avg_total_reward", n: int = 10) -> dict[str, Any]:
    """RL reward curve: the values, the means of the first and last n steps and their difference. With
    fewer than 2n steps the two windows overlap and measure nothing: means and gain are then None."""
    curve = [r[key] for r in records if r.get("phase") == "rl" and isinstance(r.get(key), (int, float))]
    out: dict[str, Any] = {"reward_curve": curve, f"first{n}_mean": None, f"last{n}_mean": None, "gain": None}
    if len(curve) >= 2 * n:
        first, last = sum(curve[:n]) / n, sum(curve[-n:]) / n
        out.update({f"first{n}_mean": first, f"last{n}_mean": last, "gain": last - first})
    return out


def summary_line(summary: dict[str, Any], n: int = 10) -> str:
    """The run's last line: the reward gain, or why there is none; wall time; the curves' PNG."""
    curve = summary["reward_curve"]
    if not curve:
        reward = "RL reward: no RL steps ran"
    elif summary["gain"] is None:
        mean = sum(curve) / len(curve)
        reward = (
            f"RL reward: mean {mean:.3f} over {len(curve)} steps; not enough steps to measure a gain "
            f"(needs {2 * n}: first-{n} vs last-{n} mean)"
        )
    else:
        reward = (
            f"RL reward: first-{n} mean {summary[f'first{n}_mean']:.3f}, last-{n} mean "
            f"{summary[f'last{n}_mean']:.3f} (gain {summary['gain']:+.3f})"
        )
    return f"{reward}; {summary['wall_time_s']:.3g} s; curves: {summary.get('png', '-')}"


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


def _finish(args: argparse.Namespace, command: str, out: Path, t0: float, rl: Trainer | None) -> dict[str, Any]:
    """summary.json and curves.png from metrics.jsonl (the records written so far)."""
    metrics = out / "metrics.jsonl"
    records = read_jsonl(metrics) if metrics.exists() else []
    summary = summarize(records)
    summary.update(
        wall_time_s=time.perf_counter() - t0,
        rl_steps=0 if rl is None else rl.step_idx,
        skipped_steps=0 if rl is None else rl.skipped_steps,
        metrics=str(metrics),
    )
    if not args.no_plot:
        if importlib.util.find_spec("matplotlib") is None:
            print("curves.png skipped: matplotlib is not installed (pip install 'ludic-fast[plot]')", file=sys.stderr)
        else:
            png = plot_curves(records, out / "curves.png", title=f"ludic-fast {command}: {args.preset}")
            summary["png"] = str(png)
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary


def main(argv: list[str]) -> int:
    """Entry point: argv[0] is "train" or "demo" (from `ludic_fast.cli`), the rest are flags. Returns 2
    after a one-line message on stderr when an input is bad (before anything is trained), 1 when training
    diverged (non-finite logits), 130 / 143 when stopped by SIGINT / SIGTERM (module docstring)."""
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
    except NonFiniteError as exc:
        error = exc
    finally:
        close_loggers(console, wandb)
    stopped = stop.requested  # read once here by every rank (under --parallel a collective)
    if error is None and args.parallel:  # every rank joins the gather; rank 0 writes
        export_hf(model if trainer is None else trainer.model, out / "model", tok)
    if not main_rank:
        return 1 if error is not None else stop.exit_code if stopped else 0
    summary = _finish(args, command, out, t0, trainer)
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


__all__ = ["main", "build_parser", "summarize", "summary_line", "prepare", "PRESETS"]
