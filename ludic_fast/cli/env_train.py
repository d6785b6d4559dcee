"""`ludic-fast train --env ...`: RL on multi-turn environment episodes (ludic_fast.agents) instead of a
prompt/answer task.

--env names an embedded environment (embedded-guess, embedded-calc) or a third party's factory
`module:function` (called with the --env-arg KEY=VALUE keywords once per episode, returning an object with
`reset(seed)` and `step(turn)`). --env-reward module:function[=WEIGHT] adds a weighted reward function of the
finished episode (repeatable; each is logged as train/episode_reward_<name>). The SFT warm-up trains on the
environment's `demonstrations(n, seed)` (the embedded ones have them) or on --sft-data; each RL batch is
--prompts-per-batch environment seeds x --group-size episodes; --max-new-tokens bounds each turn. The run
writes a sample of whole episodes to <output-dir>/episodes.jsonl (--episode-log per batch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ludic_fast.agents import EnvBatchSource, EpisodeLimits, EpisodeRunner, WeightedRewards
from ludic_fast.agents.env_registry import ENVS
from ludic_fast.agents.episode import ChatTokens, demonstration_tokens
from ludic_fast.agents.items import PER
from ludic_fast.agents.source import EnvEvaluator
from ludic_fast.agents.tools import as_tools
from ludic_fast.cli.validation import UsageError
from ludic_fast.data.types import SAWItem
from ludic_fast.engine.guard import EmptyBatchError
from ludic_fast.registry import load_attr
from ludic_fast.rollout.sampler import SamplingConfig

#: flags that only mean something with --env
ENV_ONLY = ("env_arg", "env_reward", "max_turns", "max_episode_tokens", "env_timeout", "tool_timeout",
            "format_penalty", "episode_items", "episode_log", "demonstrations")
#: single-turn task flags that do not apply with --env
TASK_ONLY = ("task", "task_arg", "eval_task", "eval_holdout", "eval_on_train", "reward", "reward_weights",
             "dynamic_sampling", "max_rounds", "tie_jitter")
#: log keys of the episode statistics, shown by the console loggers in an --env run
#: the sample of whole episodes in the output directory (a resumed run trims it to its checkpoint's batches)
EPISODE_LOG = "episodes.jsonl"
EPISODE_KEYS = ("train/episode_turns_mean", "train/episode_tool_calls_mean", "train/episode_tool_errors_mean",
                "train/episode_failed", "train/episode_truncated", "eval/success")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_env_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("environments (multi-turn episodes with tools; docs/agents.md)")
    g.add_argument("--env", default=None,
                   help=f"train on episodes of an environment: {' | '.join(ENVS.names())} | module:function")
    g.add_argument("--env-arg", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="keyword for the environment factory (repeatable; VALUE read as int/float when it parses)")
    g.add_argument("--env-reward", action="append", default=[], metavar="MODULE:FUNCTION[=WEIGHT]",
                   help="reward function of a finished episode, fn(messages, info) -> float (repeatable)")
    g.add_argument("--max-turns", type=int, default=None, help="model turns per episode (default: the env's, or 8)")
    g.add_argument("--max-episode-tokens", type=int, default=512, help="tokens per episode (prompt and all turns)")
    g.add_argument("--env-timeout", type=float, default=30.0, help="seconds each env reset/step may take")
    g.add_argument("--tool-timeout", type=float, default=30.0, help="seconds each tool call may take")
    g.add_argument("--format-penalty", type=float, default=0.0, help="reward added per malformed tool call")
    g.add_argument("--episode-items", default="episode", choices=PER,
                   help="one SAW item per episode (default) or per model turn (docs/agents.md, Credit)")
    g.add_argument("--episode-log", type=int, default=4, help="episodes per batch written to episodes.jsonl (0 = off)")
    g.add_argument("--demonstrations", type=int, default=512,
                   help="SFT warm-up conversations from the environment's demonstrations(n, seed)")


def _typed(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def env_factory(args: argparse.Namespace) -> Callable[[], Any]:
    """The --env factory with the --env-arg keywords bound; one environment is built to check it (UsageError)."""
    try:
        factory = ENVS.resolve(args.env).factory
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--env: {exc}") from None
    kwargs = {k: _typed(v) for k, v in args.env_arg}

    def make() -> Any:
        return factory(**kwargs)

    try:
        env = make()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--env {args.env} with --env-arg {kwargs}: {exc}") from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise UsageError(f"--env {args.env} built a {type(env).__name__}, which has no reset(seed) and step(turn)")
    try:
        as_tools(getattr(env, "tools", None))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--env {args.env}: its tools: {exc}") from None
    return make


def env_rewards(args: argparse.Namespace) -> WeightedRewards | None:
    """The --env-reward functions with their weights (default 1)."""
    terms = []
    for spec in args.env_reward:
        path, _, weight = spec.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise UsageError(f"--env-reward {spec!r}: the weight {weight!r} is not a number") from None
        try:
            fn = load_attr(path, "--env-reward")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        terms.append((path.rpartition(":")[2], fn, w))
    try:
        return WeightedRewards(terms) if terms else None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--env-reward: {exc}") from None


def check_env_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags of the other mode are refused: --env's own without --env, the task's with it."""
    def given(dest: str) -> bool:
        return getattr(args, dest) != parser.get_default(dest)

    if args.env is None:
        bad = next((d for d in ENV_ONLY if given(d)), None)
        if bad:
            raise UsageError(f"--{bad.replace('_', '-')} needs --env")
        return
    bad = next((d for d in TASK_ONLY if given(d)), None)
    if bad:
        raise UsageError(f"--{bad.replace('_', '-')} applies to a prompt/answer --task, not to --env")
    for name in ("max_turns", "max_episode_tokens", "demonstrations", "episode_log"):
        value = getattr(args, name)
        if value is not None and value < (0 if name in ("demonstrations", "episode_log") else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be >= {0 if name != 'max_turns' else 1}, got {value}")
    if args.env_timeout <= 0 or args.tool_timeout <= 0:
        raise UsageError("--env-timeout and --tool-timeout must be > 0")


def limits(args: argparse.Namespace) -> EpisodeLimits:
    return EpisodeLimits(max_turns=args.max_turns, max_tokens=args.max_episode_tokens,
                         max_new_tokens=args.max_new_tokens, env_timeout_s=args.env_timeout,
                         tool_timeout_s=args.tool_timeout, format_penalty=args.format_penalty)


def demonstration_items(args: argparse.Namespace, tok: Any, make_env: Callable[[], Any]) -> list[SAWItem]:
    """SFT items of the environment's demonstrations, tokenised exactly as episodes are (UsageError without)."""
    env = make_env()
    if not callable(getattr(env, "demonstrations", None)):
        raise UsageError(f"--env {args.env} has no demonstrations(n, seed) for the SFT warm-up: "
                         "pass --sft-data (chat JSONL) or --sft-steps 0")
    tools = [t.schema for t in as_tools(getattr(env, "tools", None)).values()] or getattr(env, "tool_schemas", None)
    chat = ChatTokens(tok, [tok.eos_token_id], tools=tools)
    items, too_long = [], []
    for messages in env.demonstrations(args.demonstrations, args.seed):
        t = demonstration_tokens(chat, messages)
        prompt = t.turns[0].start
        if prompt >= args.max_episode_tokens:  # as the runner: a prompt that fills the budget is not played
            too_long.append(prompt)
            continue
        items.append(SAWItem(input_ids=t.ids, attention_mask=[1] * len(t.ids), action_mask=t.action_mask,
                             weight=1.0, meta={"completion_length": sum(t.action_mask)}))
    if too_long:
        span = f"{min(too_long)}..{max(too_long)}" if min(too_long) < max(too_long) else str(too_long[0])
        what = (f"{len(too_long)} of {len(too_long) + len(items)} demonstrations have a prompt of {span} tokens, "
                f"at least --max-episode-tokens {args.max_episode_tokens}")
        if not items:
            raise EmptyBatchError(f"{what}: the SFT warm-up would train nothing; raise --max-episode-tokens above "
                                  f"{max(too_long)}, or pass --sft-steps 0")
        print(f"warning: {what}: left out of the SFT warm-up", file=sys.stderr, flush=True)
    if not items:
        raise UsageError("--demonstrations 0 leaves the SFT warm-up nothing: pass --sft-steps 0")
    return items


def env_source(args: argparse.Namespace, engine: Any, tok: Any, algo: Any, out: Path | None) -> EnvBatchSource:
    """The RL batches: --prompts-per-batch seeds x --group-size episodes, the preset's credit assigner."""
    runner = EpisodeRunner(engine, tok, limits=limits(args),
                           sampling=SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens))
    return EnvBatchSource(
        make_env=env_factory(args), runner=runner, credit_assigner=algo.credit_assigner,
        seeds_per_batch=args.prompts_per_batch, group_size=args.group_size, seed=args.seed, per=args.episode_items,
        rewards=env_rewards(args), episode_log=None if out is None or args.episode_log == 0 else out / EPISODE_LOG,
        log_episodes=args.episode_log,
    )


def env_evaluator(args: argparse.Namespace, engine: Any, tok: Any, n: int = 64) -> EnvEvaluator:
    """Greedy episodes on n fixed seeds (the same every evaluation)."""
    runner = EpisodeRunner(engine, tok, limits=limits(args),
                           sampling=SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens))
    return EnvEvaluator(make_env=env_factory(args), runner=runner, seeds=list(range(10**6, 10**6 + n)),
                        rewards=env_rewards(args))


__all__ = ["ENV_ONLY", "TASK_ONLY", "EPISODE_KEYS", "add_env_arguments", "check_env_args", "env_factory",
           "env_rewards", "limits", "demonstration_items", "env_source", "env_evaluator"]
