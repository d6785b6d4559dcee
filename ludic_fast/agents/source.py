"""`EnvBatchSource`: RL batches of environment episodes for the trainer (`await next_batch() -> SAWBatch`).

One batch: `seeds_per_batch` environment seeds (drawn from (seed, batch index), so a resumed run draws what
an uninterrupted one does), `group_size` episodes of each seed (a GRPO group: one group id per seed, the
episodes differ by sampling only), played by an `EpisodeRunner`; optional `WeightedRewards` are added to each
episode's last step; then `items.episode_items` under the credit assigner. Groups holding a failed episode
are dropped whole. An episode whose prompt alone fills the runner's `max_tokens` is not played (status "failed",
reason "prompt_length": `EpisodeRunner`): such episodes are counted (episode_prompt_too_long) and logged, and a
batch in which every episode was one raises `engine.guard.EmptyBatchError` naming the prompts' length and
--max-episode-tokens (the run would otherwise fetch empty batches forever).

Batch meta, logged with the step: avg_total_reward (over the non-failed episodes), target_rollouts, and the episode
statistics episode_turns_mean, episode_tool_calls_mean, episode_tool_errors_mean, episode_failed /
episode_truncated (counts), episode_dropped_groups, episode_prompt_too_long, episode_reward_<name> (the mean of
each reward component: the environment's own, its last step's info["rewards"], and each reward function's).
`episode_log`: a JSONL file that receives the first `log_episodes` episodes of every batch whole
(`Episode.to_record`: conversation, rewards, status, counts) for reading."""

from __future__ import annotations

import json
import logging
import random
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ludic_fast.agents.items import episode_items, trainable_groups
from ludic_fast.agents.protocol import Env
from ludic_fast.agents.rewards import WeightedRewards
from ludic_fast.agents.runner import PROMPT_TOO_LONG, Episode, EpisodeJob, EpisodeRunner
from ludic_fast.data.filters import apply_filter
from ludic_fast.data.types import CreditAssigner, SampleFilter, SAWBatch
from ludic_fast.engine.guard import EmptyBatchError
from ludic_fast.run.loggers import keep_jsonl_records

log = logging.getLogger("ludic_fast.agents")


def _mix(*parts: Any) -> int:
    return random.Random(":".join(str(p) for p in parts)).getrandbits(63)


def _reward_info(ep: Episode) -> dict[str, Any]:
    """What a reward function sees beside the messages: the last step's info and how the episode ended."""
    return {**ep.rollout.steps[-1].info, "episode_status": ep.status, "episode_reason": ep.reason}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class EnvBatchSource:
    """Episodes of `make_env()` environments as SAW batches (module docstring)."""

    def __init__(self, *, make_env: Callable[[], Env], runner: EpisodeRunner, credit_assigner: CreditAssigner,
                 seeds_per_batch: int, group_size: int, seed: int = 0, per: str = "episode",
                 rewards: WeightedRewards | None = None, sample_filter: SampleFilter | None = None,
                 episode_log: str | Path | None = None, log_episodes: int = 4):
        if seeds_per_batch < 1 or group_size < 1:
            raise ValueError(f"seeds_per_batch and group_size must be >= 1, got {seeds_per_batch}, {group_size}")
        if log_episodes < 0:
            raise ValueError(f"log_episodes must be >= 0, got {log_episodes}")
        self.make_env, self.runner, self.credit_assigner = make_env, runner, credit_assigner
        self.seeds_per_batch, self.group_size, self.seed, self.per = seeds_per_batch, group_size, seed, per
        self.rewards, self.sample_filter = rewards, sample_filter
        self.episode_log = None if episode_log is None else Path(episode_log)
        self.log_episodes = log_episodes
        self.batches = 0

    def jobs(self) -> list[EpisodeJob]:
        """This batch's episodes: seeds_per_batch seeds x group_size, one group id per seed."""
        rng = random.Random(_mix(self.seed, self.batches, "seeds"))
        version = int(getattr(self.runner.sampler, "version", 0))
        out = []
        for _ in range(self.seeds_per_batch):
            env_seed = rng.randrange(2**31)
            gid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            meta = {"request_meta": {"group_id": gid, "prompt_id": f"seed-{env_seed}"}, "group_id": gid,
                    "prompt_id": f"seed-{env_seed}", "policy_version": version}
            out.extend(EpisodeJob(self.make_env(), env_seed, dict(meta)) for _ in range(self.group_size))
        return out

    def _score(self, episodes: list[Episode]) -> dict[str, list[float]]:
        """Adds the reward functions' total to each episode's last step; {component: values} of the episodes'
        breakdowns: the environment's own (its last step's info["rewards"]) and the reward functions'."""
        parts: dict[str, list[float]] = {}
        for ep in episodes:
            if ep.status == "failed" or not ep.rollout.steps:
                continue
            last = ep.rollout.steps[-1]
            components = dict(last.info.get("rewards") or {})
            if self.rewards is not None:
                try:
                    total, extra = self.rewards.score(ep.messages, _reward_info(ep))
                except Exception as exc:  # noqa: BLE001 - a reward function's fault fails that episode only
                    ep.end("failed", error=f"reward: {type(exc).__name__}: {exc}")
                    continue
                last.reward += total
                components.update(extra)
                last.info["rewards"] = components
            for name, value in components.items():
                parts.setdefault(name, []).append(float(value))
        return parts

    async def next_batch(self) -> SAWBatch:
        episodes = await self.runner.run(self.jobs(), seed=_mix(self.seed, self.batches, "sampling"))
        too_long = self._prompts_too_long(episodes)
        parts = self._score(episodes)
        trainable, dropped = trainable_groups(episodes)
        items = apply_filter(episode_items(trainable, self.credit_assigner, per=self.per), self.sample_filter)
        self._log(episodes)
        self.batches += 1
        played = [e for e in episodes if e.status != "failed"]
        meta: dict[str, Any] = {
            "target_rollouts": len(trainable),
            "num_samples": len(items),
            "avg_total_reward": _mean([e.rollout.total_reward for e in played]),
            "avg_completion_length": _mean([i.meta["completion_length"] for i in items]),
            "episode_turns_mean": _mean([e.turns for e in played]),
            "episode_tool_calls_mean": _mean([e.tool_calls for e in played]),
            "episode_tool_errors_mean": _mean([e.tool_errors for e in played]),
            "episode_failed": float(len(episodes) - len(played)),
            "episode_truncated": float(sum(e.status == "truncated" for e in episodes)),
            "episode_dropped_groups": float(dropped),
            "episode_prompt_too_long": float(too_long),
            "policy_version": int(getattr(self.runner.sampler, "version", 0)),
        }
        meta.update({f"episode_reward_{name}": _mean(v) for name, v in parts.items()})
        return SAWBatch(items=items, meta=meta)

    def _prompts_too_long(self, episodes: list[Episode]) -> int:
        """How many episodes were not played for their prompt's length (logged); EmptyBatchError when all were
        (their records logged first)."""
        lengths = [len(e.tokens.ids) for e in episodes if e.reason == PROMPT_TOO_LONG]
        if not lengths:
            return 0
        budget = self.runner.limits.max_tokens
        what = (f"prompt of {min(lengths)}..{max(lengths)} tokens" if min(lengths) < max(lengths)
                else f"prompt of {lengths[0]} tokens")
        if len(lengths) == len(episodes):
            self._log(episodes)
            raise EmptyBatchError(
                f"batch {self.batches}: every episode's {what} fills the episode's budget max_tokens={budget} "
                f"(--max-episode-tokens {budget}): nothing to play or train; raise --max-episode-tokens above "
                f"{max(lengths)} or shorten the environment's prompt")
        log.warning("batch %d: %d of %d episodes not played: their %s fills max_tokens=%d (--max-episode-tokens)",
                    self.batches, len(lengths), len(episodes), what, budget)
        return len(lengths)

    def _log(self, episodes: list[Episode]) -> None:
        if self.episode_log is None or self.log_episodes == 0:
            return
        self.episode_log.parent.mkdir(parents=True, exist_ok=True)
        with self.episode_log.open("a", encoding="utf-8") as f:
            for ep in episodes[: self.log_episodes]:
                f.write(json.dumps({"batch": self.batches, **ep.to_record()}, default=str) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume after `state["batches"]` batches; the episode log's records of later batches go (they are
        played and logged again)."""
        self.batches = int(state["batches"])
        if self.episode_log is not None:
            keep_jsonl_records(self.episode_log, lambda r: r["batch"] < self.batches)



class EnvEvaluator:
    """`evaluate()` -> eval metrics of one episode per fixed seed (a greedy runner gives the same episodes for
    the same weights): reward (mean return), success (fraction with return >= 1), turns, tool_calls, failed."""

    def __init__(self, *, make_env: Callable[[], Env], runner: EpisodeRunner, seeds: list[int],
                 rewards: WeightedRewards | None = None):
        if not seeds:
            raise ValueError("EnvEvaluator needs at least one seed")
        self.make_env, self.runner, self.seeds, self.rewards = make_env, runner, list(seeds), rewards

    async def evaluate(self) -> dict[str, float]:
        episodes = await self.runner.run([EpisodeJob(self.make_env(), s) for s in self.seeds], seed=0)
        played = [e for e in episodes if e.status != "failed"]
        returns = []
        for e in played:
            extra = self.rewards.score(e.messages, _reward_info(e))[0] if self.rewards else 0.0
            returns.append(e.rollout.total_reward + extra if e.rollout.steps else 0.0)
        return {
            "reward": _mean(returns),
            "success": _mean([float(r >= 1.0) for r in returns]),
            "episode_turns": _mean([e.turns for e in played]),
            "episode_tool_calls": _mean([e.tool_calls for e in played]),
            "episode_failed": float(len(episodes) - len(played)),
            "num_samples": float(len(episodes)),
        }


__all__ = ["EnvBatchSource", "EnvEvaluator"]
