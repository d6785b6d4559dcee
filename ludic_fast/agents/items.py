"""Played episodes -> credit -> SAW items (Ludic's one item per step, or one item per episode).

per="step": one item per model turn, `saw_item_from_step` of its trace: input = every token before the turn
(earlier turns included, as context) + the turn's sampled tokens, action mask on this turn only, weight =
the step's credit. Each sampled token is an action in exactly one item. Any credit assigner works: episodic
return, per-step reward, discounted return / GAE (`ludic_fast.data.credit`).

per="episode": one item per episode: its whole sequence, action mask on every sampled token, actor log-probs
of all turns in order, weight = the episode's credit. The scalar weight needs one credit per episode: a
credit map that gives an episode's steps different values is a ValueError (use per="step").

Group normalisation across the episodes of one seed: the source gives the episodes of one seed one
group id, so `GroupNormalizedReturn(group_size)` normalises each episode's return Σ_t r_t within them.
Failed episodes are never trained: a group with a failed episode is dropped whole (its baseline would
be wrong), and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ludic_fast.agents.runner import Episode
from ludic_fast.data.batching import saw_item_from_step
from ludic_fast.data.types import ActorTokenLogps, CreditAssigner, SampleAttachments, SAWItem, group_id_of

PER = ("step", "episode")


def episode_meta(ep: Episode) -> dict[str, Any]:
    """Counts and status of an episode, copied into its items' meta."""
    return {"episode_turns": ep.turns, "episode_tool_calls": ep.tool_calls, "episode_tool_errors": ep.tool_errors,
            "episode_status": ep.status, "episode_reason": ep.reason}


def trainable_groups(episodes: Sequence[Episode]) -> tuple[list[Episode], int]:
    """The episodes of groups without a failed (or empty) episode, and how many groups were dropped."""
    groups: dict[str, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(group_id_of(ep.rollout.meta) or ep.rollout.id, []).append(ep)
    kept = [g for g in groups.values() if all(e.status != "failed" and e.rollout.steps for e in g)]
    return [e for g in kept for e in g], len(groups) - len(kept)


def episode_item(ep: Episode, weight: float) -> SAWItem:
    """The whole sequence of `ep` as one item (module docstring)."""
    toks = ep.tokens
    last = ep.rollout.steps[-1]
    meta = {
        "rollout_id": ep.rollout.id, "step_index": last.index, "reward": last.reward,
        "total_reward": ep.rollout.total_reward, "completion_length": sum(toks.action_mask),
        "prompt_length": toks.turns[0].start if toks.turns else len(toks.ids),
        "truncated": ep.status == "truncated", "terminated": ep.status == "done",
        "finish_reason": last.trace.finish_reason if last.trace else None,
        **ep.rollout.meta, **episode_meta(ep),
    }
    end = toks.turns[-1].end  # context after the last turn trains nothing
    return SAWItem(
        input_ids=toks.ids[:end], attention_mask=[1] * end, action_mask=toks.action_mask[:end], weight=weight,
        meta=meta, attachments=SampleAttachments(ActorTokenLogps(toks.action_logprobs)),
    )


def episode_items(episodes: Sequence[Episode], credit_assigner: CreditAssigner, *, per: str = "episode"
                  ) -> list[SAWItem]:
    """SAW items of the given (trainable) episodes under `credit_assigner` (module docstring)."""
    if per not in PER:
        raise ValueError(f"per must be one of {PER}, got {per!r}")
    rollouts = [ep.rollout for ep in episodes]
    credit = credit_assigner.compute(rollouts) if rollouts else {}
    items = []
    for ep in episodes:
        weights = [credit[(ep.rollout.id, s.index)] for s in ep.rollout.steps]
        if per == "episode":
            if len(set(weights)) > 1:
                raise ValueError(
                    f"per='episode' needs one credit per episode, but {type(credit_assigner).__name__} gives the "
                    f"steps of rollout {ep.rollout.id} different ones ({weights}): use per='step'"
                )
            items.append(episode_item(ep, weights[0]))
            continue
        for step, w in zip(ep.rollout.steps, weights, strict=True):
            item = saw_item_from_step(ep.rollout, step, w)
            item.meta.update(episode_meta(ep))
            items.append(item)
    return items


__all__ = ["PER", "episode_meta", "trainable_groups", "episode_item", "episode_items"]
