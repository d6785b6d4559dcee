"""Synchronous rollouts -> credit -> SAW items: `RolloutBatchSource`, and the evaluation loop `Evaluator`.

One batch: take `prompts_per_batch` prompts of the task (seeded shuffle per epoch, prompts retired by a
`NoPositiveResampling` curriculum left out), sample `group_size` completions of each (a GRPO group:
one uuid group id, `meta["request_meta"]["group_id"]`), score them with the task's reward, run the
credit assigner, build one SAW item per completion (`batching.saw_item_from_step`).

DAPO dynamic sampling (`dynamic_sampling=True`): groups whose rewards all tie carry no signal; sampling
rounds continue until `prompts_per_batch` groups with non-zero reward variance are collected or
`max_rounds` rounds are spent (then the batch has fewer groups). `oversampling_factor` = groups sampled
/ groups wanted is logged, and so are `zero_variance_group_frac` (kept groups whose raw rewards all tie,
a group of one included: group-relative credit gives them advantage 0) and `zero_weight_frac` (items
whose credit is 0). Mixed-sampling enforcement (`tie_jitter > 0`, off by default): every reward of a
fully tied group gets an independent uniform jitter in [-tie_jitter, tie_jitter], so group-normalised
credit never divides a zero spread.

Every random draw is seeded from (seed, batch index, round), so a resumed run (`load_state_dict`) samples
exactly what an uninterrupted one does.

Data-parallel ranks (`rank`, `world_size`; `ludic_fast.distributed.launch`): every rank walks the same prompt
order and samples groups rank, rank + W, ... of the batch's `prompts_per_batch` (groups stay whole on a rank).
With `per_group_seeds` each group is sampled by its own `generate` call under a seed of (seed, batch, round,
the group's place in the global batch), so a group's completions do not depend on which rank, or how many
ranks, sample it: W ranks sample the union a one-rank run samples, and a checkpoint resumes on any W.
Dynamic sampling and a curriculum decide from every group of a batch, so they need `world_size == 1`.
"""

from __future__ import annotations

import random
import statistics
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

from ludic_fast.data.batching import saw_item_from_step
from ludic_fast.data.filters import apply_filter
from ludic_fast.data.types import CreditAssigner, Rollout, SampleFilter, SAWBatch, Step, TokenTrace
from ludic_fast.rollout.prompts import encode_prompt, resolve_chat_template
from ludic_fast.rollout.sampler import Completion, Sampler, SamplingConfig
from ludic_fast.rollout.tasks import PromptAnswerTask
from ludic_fast.run.stats import Reducer, apply_reducers_to_records


def _mix_seed(*parts: int) -> int:
    return random.Random(":".join(str(p) for p in parts)).getrandbits(63)


def _sampler_argument(sampler: Sampler | None, engine: Sampler | None) -> Sampler:
    """`sampler=`, or the deprecated `engine=` (a DeprecationWarning); a TypeError for both or neither."""
    if (sampler is None) == (engine is None):
        raise TypeError("pass the rollout sampler as sampler= (engine= is its deprecated old name), exactly once")
    if engine is not None:
        warnings.warn("engine= is deprecated: pass sampler= (the rollout side is a Sampler; ludic_fast.engine "
                      "is the training engine)", DeprecationWarning, stacklevel=3)
    return sampler if sampler is not None else engine


def _component_means(rollouts: list[Rollout]) -> dict[str, float]:
    """`reward/<name>`: the mean of each reward component over the rollouts that have it (`task.components`)."""
    return component_means([r.meta["reward_components"] for r in rollouts if "reward_components" in r.meta])


def component_means(parts: list[dict[str, float]]) -> dict[str, float]:
    """{"reward/<name>": mean of the values named `name`} over the dicts that name it (a task's rows may have
    different components, e.g. a per-dataset score)."""
    sums: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p.items():
            sums.setdefault(k, []).append(float(v))
    return {f"reward/{k}": sum(v) / len(v) for k, v in sums.items()}


def completion_text(tokenizer: Any, completion: Completion) -> str:
    return tokenizer.decode(completion.completion_ids, skip_special_tokens=True)


class RolloutBatchSource:
    """`await next_batch()` -> SAWBatch of `prompts_per_batch x group_size` scored completions (module docstring).

    sampler: the `rollout.sampler.Sampler` (`generate(prompts, sampling, seed=) -> [Completion]`, an int
    `version`); `engine=` is its deprecated old name. The mean of each of the task's reward components
    (`task.components`: each function's score of a `rewards.WeightedReward`, a reasoning-gym task's per-dataset
    score) over the sampled rollouts is in the batch meta as `reward/<name>`.
    curriculum: optional NoPositiveResampling; its retired prompts leave the next epoch.
    chat_template: prompts through the tokenizer's chat template (None: whenever it has one), as
    `rollout.prompts.encode_prompt`; train SFT with the same choice (`prompts.sft_item`).
    """

    def __init__(
        self,
        *,
        sampler: Sampler | None = None,
        task: PromptAnswerTask,
        tokenizer: Any,
        credit_assigner: CreditAssigner,
        prompts_per_batch: int,
        group_size: int,
        sampling: SamplingConfig,
        seed: int = 0,
        dynamic_sampling: bool = False,
        max_rounds: int = 4,
        tie_jitter: float = 0.0,
        curriculum: Any = None,
        sample_filter: SampleFilter | None = None,
        chat_template: bool | None = None,
        rank: int = 0,
        world_size: int = 1,
        per_group_seeds: bool = False,
        engine: Sampler | None = None,
    ):
        sampler = _sampler_argument(sampler, engine)
        if prompts_per_batch < 1 or group_size < 1:
            raise ValueError(f"prompts_per_batch and group_size must be >= 1, got {prompts_per_batch}, {group_size}")
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        if tie_jitter < 0:
            raise ValueError(f"tie_jitter must be >= 0, got {tie_jitter}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        if world_size > 1:
            if prompts_per_batch % world_size:
                raise ValueError(f"prompts_per_batch ({prompts_per_batch}) must be a multiple of world_size "
                                 f"({world_size}): each rank samples an equal share of the groups")
            if dynamic_sampling or curriculum is not None:
                raise ValueError("dynamic_sampling and a curriculum decide from every group of a batch: they need "
                                 f"world_size == 1, got {world_size}")
        self.sampler, self.task, self.tokenizer = sampler, task, tokenizer
        self.credit_assigner = credit_assigner
        self.prompts_per_batch, self.group_size = prompts_per_batch, group_size
        self.sampling, self.seed = sampling, seed
        self.dynamic_sampling, self.max_rounds, self.tie_jitter = dynamic_sampling, max_rounds, tie_jitter
        self.curriculum, self.sample_filter = curriculum, sample_filter
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self.rank, self.world_size, self.per_group_seeds = rank, world_size, per_group_seeds or world_size > 1
        self.batches = 0
        self.epoch = 0
        self.cursor = 0
        self._order: list[int] = []

    # ------------------------------------------------------------------------------------- prompts
    def _epoch_order(self) -> list[int]:
        ids = list(range(len(self.task.samples)))
        if self.curriculum is not None:
            active = set(self.curriculum.active([self.task.samples[i]["id"] for i in ids]))
            ids = [i for i in ids if self.task.samples[i]["id"] in active] or ids
        random.Random(_mix_seed(self.seed, self.epoch)).shuffle(ids)
        return ids

    def _next_prompts(self, n: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < n:
            if not self._order or self.cursor >= len(self._order):
                if self._order:
                    self.epoch += 1
                self._order = self._epoch_order()
                self.cursor = 0
            out.append(self.task.samples[self._order[self.cursor]])
            self.cursor += 1
        return out

    # ------------------------------------------------------------------------------------- rollouts
    def _complete(self, samples: list[dict[str, Any]], places: list[int], round_idx: int) -> list[list[Completion]]:
        """`group_size` completions of each sample: one `generate` call for all (seeded by batch and round), or
        one per group seeded by its place in the global batch (`per_group_seeds`)."""
        prompts = [encode_prompt(self.tokenizer, s["prompt"], chat_template=self.chat_template) for s in samples]
        if self.per_group_seeds:
            return [self.sampler.generate([p] * self.group_size, self.sampling,
                                         seed=_mix_seed(self.seed, self.batches, round_idx, 3, g))
                    for p, g in zip(prompts, places)]
        flat = [p for p in prompts for _ in range(self.group_size)]
        completions = self.sampler.generate(flat, self.sampling, seed=_mix_seed(self.seed, self.batches, round_idx))
        return [completions[g * self.group_size : (g + 1) * self.group_size] for g in range(len(samples))]

    def _sample_groups(self, samples: list[dict[str, Any]], round_idx: int) -> list[list[Rollout]]:
        """This rank's groups of the global `samples` (all of them on one rank)."""
        places = list(range(self.rank, len(samples), self.world_size))
        samples = [samples[g] for g in places]
        rank_part = [self.rank] if self.world_size > 1 else []  # distinct group ids on each rank
        rng = random.Random(_mix_seed(self.seed, self.batches, round_idx, 1, *rank_part))
        completions = self._complete(samples, places, round_idx)
        version = int(getattr(self.sampler, "version", 0))
        groups = []
        for g, sample in enumerate(samples):
            gid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            group = []
            for c in completions[g]:
                text = completion_text(self.tokenizer, c)
                reward = self.task.reward(text, sample)
                components = self.task.components(text, sample)
                trace = TokenTrace(c.prompt_ids, c.completion_ids, c.logprobs, c.finish_reason)
                step = Step(
                    index=0,
                    prev_obs=sample["prompt"],
                    action=text,
                    next_obs=None,
                    reward=reward,
                    truncated=c.finish_reason == "length",
                    terminated=c.finish_reason == "stop",
                    trace=trace,
                )
                meta = {
                    "request_meta": {"group_id": gid, "prompt_id": sample["id"]},
                    "group_id": gid,
                    "prompt_id": sample["id"],
                    "policy_version": version,
                    "sampling_temperature": self.sampling.temperature,  # the RL objective scores at it
                    "engine": {"return_spec": {"return_chosen_logprobs": True}},
                }
                if components is not None:  # the reward's named parts, logged per batch
                    meta["reward_components"] = components
                group.append(Rollout(steps=[step], meta=meta, id=str(uuid.UUID(int=rng.getrandbits(128), version=4))))
            groups.append(group)
        return groups

    def _jitter_ties(self, groups: list[list[Rollout]]) -> None:
        rng = random.Random(_mix_seed(self.seed, self.batches, 2))
        for group in groups:
            if len(group) > 1 and len({r.total_reward for r in group}) == 1:
                for r in group:
                    r.steps[-1].reward += rng.uniform(-self.tie_jitter, self.tie_jitter)

    async def next_batch(self) -> SAWBatch:
        kept: list[list[Rollout]] = []
        all_rollouts: list[Rollout] = []
        sampled_groups = 0
        rounds = 0
        while rounds < (self.max_rounds if self.dynamic_sampling else 1):
            need = self.prompts_per_batch - len(kept)
            groups = self._sample_groups(self._next_prompts(need), rounds)
            rounds += 1
            sampled_groups += len(groups)
            all_rollouts += [r for g in groups for r in g]
            if self.dynamic_sampling:
                groups = [g for g in groups if statistics.pstdev([r.total_reward for r in g]) > 0]
            kept += groups
            if len(kept) >= self.prompts_per_batch:
                break
        self.batches += 1
        raw_rewards = [r.total_reward for r in all_rollouts]
        tied = sum(len({r.total_reward for r in g}) <= 1 for g in kept)
        if self.tie_jitter > 0:
            self._jitter_ties(kept)
        rollouts = [r for g in kept for r in g]
        credit = self.credit_assigner.compute(rollouts) if rollouts else {}
        items = [saw_item_from_step(r, s, credit[(r.id, s.index)]) for r in rollouts for s in r.steps]
        n_before = len(items)
        items = apply_filter(items, self.sample_filter)
        meta = {
            "target_rollouts": len(rollouts),
            "num_samples_before_filter": n_before,
            "num_samples": len(items),
            "num_samples_filtered": n_before - len(items),
            "avg_total_reward": sum(raw_rewards) / len(raw_rewards) if raw_rewards else 0.0,
            "avg_completion_length": sum(i.meta["completion_length"] for i in items) / len(items) if items else 0.0,
            "oversampling_factor": sampled_groups * self.world_size / self.prompts_per_batch,
            "zero_variance_group_frac": tied / len(kept) if kept else 1.0,
            "zero_weight_frac": sum(i.weight == 0 for i in items) / len(items) if items else 1.0,
            "rollout_rounds": rounds,
            "policy_version": int(getattr(self.sampler, "version", 0)),
        }
        meta.update(_component_means(all_rollouts))
        return SAWBatch(items=items, meta=meta)

    # ------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "epoch": self.epoch, "cursor": self.cursor, "order": list(self._order)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batches, self.epoch, self.cursor = int(state["batches"]), int(state["epoch"]), int(state["cursor"])
        self._order = [int(i) for i in state["order"]]


class Evaluator:
    """Greedy (by default) completions of the eval prompts, scored by the task: `eval/<metric>` values.

    Metrics: reward (mean), accuracy (fraction with reward >= 1), avg_completion_length,
    completion_truncated_rate, reward/<name> (the mean of each of the task's reward components), plus the
    given reducers over per-completion records `{"reward", "finish_reason", "completion_length",
    "prompt_id"}`. `batch_size` completions are decoded together (the concurrency of the CPU/GPU sampler).
    `sampler` (`engine=`: its deprecated old name) and `chat_template` as in RolloutBatchSource.
    """

    def __init__(
        self,
        *,
        sampler: Sampler | None = None,
        task: PromptAnswerTask,
        tokenizer: Any,
        samples: list[dict[str, Any]] | None = None,
        sampling: SamplingConfig | None = None,
        batch_size: int = 64,
        reducers: Mapping[str, Reducer] | None = None,
        seed: int = 0,
        chat_template: bool | None = None,
        engine: Sampler | None = None,
    ):
        self.sampler, self.task, self.tokenizer = _sampler_argument(sampler, engine), task, tokenizer
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self.samples = list(samples if samples is not None else (task.eval_samples or task.samples))
        if not self.samples:
            raise ValueError("Evaluator needs at least one sample")
        self.sampling = sampling or SamplingConfig(temperature=0.0, max_new_tokens=32)
        self.batch_size, self.reducers, self.seed = batch_size, dict(reducers or {}), seed

    def evaluate(self) -> dict[str, float]:
        records: list[dict[str, Any]] = []
        parts: list[dict[str, float]] = []
        for start in range(0, len(self.samples), self.batch_size):
            chunk = self.samples[start : start + self.batch_size]
            prompts = [encode_prompt(self.tokenizer, s["prompt"], chat_template=self.chat_template) for s in chunk]
            for s, c in zip(chunk, self.sampler.generate(prompts, self.sampling, seed=_mix_seed(self.seed, start))):
                text = completion_text(self.tokenizer, c)
                records.append(
                    {
                        "reward": self.task.reward(text, s),
                        "finish_reason": c.finish_reason,
                        "completion_length": len(c.completion_ids),
                        "prompt_id": s["id"],
                    }
                )
                parts.append(self.task.components(text, s) or {})
        n = len(records)
        out = {
            "reward": sum(r["reward"] for r in records) / n,
            "accuracy": sum(r["reward"] >= 1.0 for r in records) / n,
            "avg_completion_length": sum(r["completion_length"] for r in records) / n,
            "completion_truncated_rate": sum(r["finish_reason"] == "length" for r in records) / n,
            "num_samples": float(n),
        }
        out.update(component_means(parts))
        out.update(apply_reducers_to_records(records, self.reducers))
        return out


__all__ = ["RolloutBatchSource", "Evaluator", "completion_text", "component_means"]
