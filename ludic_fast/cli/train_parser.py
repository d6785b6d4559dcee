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
import json
from typing import Any

import torch

from ludic_fast.cli import env_train, parallel
from ludic_fast.cli.dataset_presets import add_arguments as add_offline_arguments
from ludic_fast.cli.presets import PRESETS as PRESET_RECORDS
from ludic_fast.cli.presets import presets_epilog
from ludic_fast.cli.recipe import add_recipe_arguments, profile_default_help
from ludic_fast.cli.validation import OneLineParser, comma_numbers
from ludic_fast.ops.budget import parse_memory_budget
from ludic_fast.rollout.sampler import SAMPLERS


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

