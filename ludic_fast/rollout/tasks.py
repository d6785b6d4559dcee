"""Prompt/answer tasks: a list of `{"id", "prompt", "answer"}` samples plus a reward function.

`PromptAnswerTask.from_jsonl(path, reward="exact")` reads one JSON object per line (keys configurable);
`embedded_default_task()` is the built-in addition task of `ludic_fast.embedded`.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ludic_fast.data.jsonl import jsonl_objects
from ludic_fast.embedded import AdditionTask
from ludic_fast.rollout.rewards import RewardFn, get_reward


@dataclass
class PromptAnswerTask:
    """Samples `{"id", "prompt", "answer"}` (train and eval) scored by `reward_fn(completion_text, answer)`."""

    samples: list[dict[str, Any]]
    reward_fn: RewardFn
    name: str = "task"
    eval_samples: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for split, rows in (("samples", self.samples), ("eval_samples", self.eval_samples)):
            for i, s in enumerate(rows):
                if not isinstance(s, dict) or "prompt" not in s or "answer" not in s:
                    raise ValueError(f"{split}[{i}] must be a dict with 'prompt' and 'answer'")
                s.setdefault("id", f"{split}-{i}")
        if not self.samples:
            raise ValueError("samples must not be empty")

    def reward(self, completion: str, sample: dict[str, Any]) -> float:
        return float(self.reward_fn(completion, sample["answer"]))

    def components(self, completion: str, sample: dict[str, Any]) -> dict[str, float] | None:
        """Named parts of the reward logged as `reward/<name>` (each reward function's score of a
        `WeightedReward`), or None."""
        scores = getattr(self.reward_fn, "scores", None)
        return None if scores is None else scores(completion, sample["answer"])

    def hold_out(self, fraction: float, *, seed: int = 0) -> PromptAnswerTask:
        """A copy whose eval samples are round(fraction·n) (at least 1) rows moved out of the training
        samples (seeded shuffle); raises ValueError when that would leave no training row."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must lie in (0, 1), got {fraction}")
        n_eval = max(1, round(fraction * len(self.samples)))
        if n_eval >= len(self.samples):
            raise ValueError(f"holding out {n_eval} of {len(self.samples)} rows leaves none to train on")
        order = list(range(len(self.samples)))
        random.Random(seed).shuffle(order)
        held = set(order[:n_eval])
        train = [s for i, s in enumerate(self.samples) if i not in held]
        evals = [s for i, s in enumerate(self.samples) if i in held]
        return PromptAnswerTask(train, self.reward_fn, name=self.name, eval_samples=evals)

    @classmethod
    def from_jsonl(
        cls,
        path: str | os.PathLike[str],
        *,
        reward: str | RewardFn = "exact",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        eval_path: str | os.PathLike[str] | None = None,
    ) -> PromptAnswerTask:
        """Rows `{prompt_key: str, answer_key: str|number, "id"?: str}` from JSONL file(s); each sample keeps
        its `"source"` ("path:line"). A malformed line raises ValueError naming the file and line."""

        def read(p: str | os.PathLike[str]) -> list[dict[str, Any]]:
            rows = []
            for n, obj in jsonl_objects(p):
                if prompt_key not in obj or answer_key not in obj:
                    raise ValueError(f"{p}:{n}: missing {prompt_key!r} or {answer_key!r}")
                rows.append(
                    {
                        "id": str(obj.get("id", f"{Path(p).stem}-{n - 1}")),
                        "prompt": str(obj[prompt_key]),
                        "answer": str(obj[answer_key]),
                        "source": f"{p}:{n}",
                    }
                )
            if not rows:
                raise ValueError(f"{p}: no rows (expected one JSON object per line)")
            return rows

        fn = get_reward(reward) if isinstance(reward, str) else reward
        return cls(read(path), fn, name=Path(path).stem, eval_samples=read(eval_path) if eval_path else [])


def embedded_default_task(*, max_operand: int = 9, seed: int = 0, held_out_eval: bool = False) -> PromptAnswerTask:
    """The built-in addition task (exact-match reward) on the train split of `AdditionTask`.

    Eval samples: the train problems themselves (greedy pass@1 on the problems RL practises: single-digit
    sums are facts to memorise, which a tiny model does not generalise to unseen pairs in minutes), or the
    disjoint held-out split with `held_out_eval=True`.
    """
    task = AdditionTask(max_operand=max_operand, seed=seed)
    n = (max_operand + 1) ** 2
    n_eval = n // 5
    train = task.samples("train", n - n_eval)
    evals = task.samples("eval", n_eval) if held_out_eval else [dict(s) for s in train]
    return PromptAnswerTask(train, get_reward("exact"), name="addition", eval_samples=evals)


__all__ = ["PromptAnswerTask", "embedded_default_task"]
