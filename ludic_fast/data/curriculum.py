"""No-Positive-Resampling (ScaleRL, arXiv 2510.13786): retire prompts the policy already solves.

Per prompt p the history keeps (successes_p, attempts_p) over every rollout seen; its pass rate is
successes_p / attempts_p, a rollout succeeding when its total reward > `success_threshold`. Once a
prompt's pass rate reaches `threshold` (0.9) with at least `min_attempts` attempts it is retired for
good: `active()` leaves it out of later epochs' prompt lists. (It stays in the epoch being run: the
caller decides when an epoch starts by calling `active()` again.)

The history is JSON, written atomically (`ludic_fast.run.atomic_io`) after every update when `path` is set:
a crash at any point leaves either the old or the new file, never a partial one; a new instance with the
same path restores it (resume). `state_dict()` / `load_state_dict()` give the same JSON-compatible state
for checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ludic_fast.data.types import SAWBatch
from ludic_fast.run.atomic_io import atomic_write_json

_VERSION = 1


def default_prompt_key(meta: Mapping[str, Any]) -> str:
    """The prompt id of an item or rollout: meta['prompt_id'], else meta['request_meta']['prompt_id']."""
    if meta.get("prompt_id") is not None:
        return str(meta["prompt_id"])
    request_meta = meta.get("request_meta")
    if isinstance(request_meta, Mapping) and request_meta.get("prompt_id") is not None:
        return str(request_meta["prompt_id"])
    raise ValueError("NoPositiveResampling needs a prompt_id in meta (or meta['request_meta']) to key its history")


class NoPositiveResampling:
    """Prompt pass-rate history that permanently retires prompts with pass rate ≥ threshold.

    Use `observe(prompt_id, rewards)` from the rollout side, or `preprocess` as an RLAlgorithm preprocess
    step (it records one outcome per rollout of the batch and returns the batch unchanged), and
    `active(prompt_ids)` when building the next epoch's prompts.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        threshold: float = 0.9,
        min_attempts: int = 1,
        success_threshold: float = 0.0,
        prompt_key: Callable[[Mapping[str, Any]], str] = default_prompt_key,
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must lie in (0, 1], got {threshold}")
        if min_attempts < 1:
            raise ValueError(f"min_attempts must be >= 1, got {min_attempts}")
        self.path = None if path is None else Path(path)
        self.threshold = float(threshold)
        self.min_attempts = int(min_attempts)
        self.success_threshold = float(success_threshold)
        self.prompt_key = prompt_key
        self.history: dict[str, list[int]] = {}
        self.retired: set[str] = set()
        if self.path is not None and self.path.exists():
            self.load_state_dict(json.loads(self.path.read_text(encoding="utf-8")))

    # ---------------------------------------------------------------------------------------- queries
    def pass_rate(self, prompt_id: Any) -> float | None:
        """successes / attempts of the prompt, or None when it was never seen."""
        record = self.history.get(str(prompt_id))
        return None if record is None else record[0] / record[1]

    def is_retired(self, prompt_id: Any) -> bool:
        return str(prompt_id) in self.retired

    def active(self, prompt_ids: Iterable[Any]) -> list[Any]:
        """The prompt ids that are not retired, in order (call when building an epoch)."""
        return [p for p in prompt_ids if str(p) not in self.retired]

    # ---------------------------------------------------------------------------------------- updates
    def observe(self, prompt_id: Any, rewards: Iterable[float], *, save: bool = True) -> None:
        """Record one attempt per reward for the prompt; retire it once its pass rate reaches the threshold."""
        key = str(prompt_id)
        rewards = [float(r) for r in rewards]
        record = self.history.setdefault(key, [0, 0])
        record[0] += sum(r > self.success_threshold for r in rewards)
        record[1] += len(rewards)
        if record[1] >= self.min_attempts and record[0] / record[1] >= self.threshold:
            self.retired.add(key)
        if save:
            self.save()

    def preprocess(self, saw_batch: SAWBatch) -> SAWBatch:
        """Record each rollout of the batch once (meta['total_reward'], deduplicated by meta['rollout_id'])."""
        seen: set[Any] = set()
        outcomes: dict[str, list[float]] = {}
        for idx, item in enumerate(saw_batch.items):
            rollout_id = item.meta.get("rollout_id", ("item", idx))
            if rollout_id in seen:
                continue
            seen.add(rollout_id)
            reward = item.meta.get("total_reward", item.meta.get("reward"))
            if reward is None:
                raise ValueError(f"item {idx} has no meta['total_reward'] for NoPositiveResampling")
            outcomes.setdefault(self.prompt_key(item.meta), []).append(float(reward))
        for prompt_id, rewards in outcomes.items():
            self.observe(prompt_id, rewards, save=False)
        if outcomes:
            self.save()
        return saw_batch

    # ------------------------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "threshold": self.threshold,
            "history": {k: list(v) for k, v in self.history.items()},
            "retired": sorted(self.retired),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _VERSION:
            raise ValueError(f"unsupported NoPositiveResampling state version {state.get('version')!r}")
        history = state["history"]
        if not isinstance(history, Mapping) or any(
            not isinstance(v, list) or len(v) != 2 or not 0 <= v[0] <= v[1] for v in history.values()
        ):
            raise ValueError("NoPositiveResampling state: history must map prompt ids to [successes, attempts]")
        self.history = {str(k): [int(v[0]), int(v[1])] for k, v in history.items()}
        self.retired = {str(p) for p in state["retired"]}

    def save(self) -> None:
        """Persist the history atomically (no-op without a path)."""
        if self.path is not None:
            atomic_write_json(self.path, self.state_dict())


__all__ = ["NoPositiveResampling", "default_prompt_key"]
