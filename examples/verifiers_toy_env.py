"""A small verifiers environment module (verifiers 0.3.x `load_environment()` API), nothing to download: the
single-turn, multi-turn and tool environments `ludic_fast.agents.libraries.verifiers` is tested and shown on.

    load_environment(kind="single" | "multi" | "tool", num_examples=64, seed=0, system_prompt=None)

- single (`SingleTurnEnv`): "copy: k" -> the reply "k". Rubric: `exact` (weight 1.0: the reply equals the
  letter) + `short` (weight 0.2: the reply has at most 2 characters).
- multi (`MultiTurnEnv`, up to 3 turns): the same question; `env_response` answers a wrong reply with the letter
  ("no, it is k. copy: k") and ends the rollout on a right one ("correct", its final response). Rubric:
  `exact` (weight 1.0, the last reply) + `first_try` (weight 0.5: solved in the first turn).
- tool (`ToolEnv`, up to 3 turns): "a+b=?" with two-digit numbers and the tool `add(a, b)`; rubric `exact`
  (weight 1.0: the last reply is the sum).

Train on it: `ludic-fast train --env ludic_fast.agents.libraries.verifiers:make_env --env-arg
env=examples/verifiers_toy_env.py --env-arg kind=single` (docs/environments.md).
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

LETTERS = "abcdefghij"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def _last_reply(parser: vf.Parser, completion: vf.Messages) -> str:
    return (parser.parse_answer(completion) or "").strip()


def exact(parser: vf.Parser, completion: vf.Messages, answer: str) -> float:
    """1 when the last reply equals the answer."""
    return float(_last_reply(parser, completion) == answer)


def short(parser: vf.Parser, completion: vf.Messages) -> float:
    """1 when the last reply has at most 2 characters."""
    return float(len(_last_reply(parser, completion)) <= 2)


def first_try(parser: vf.Parser, completion: vf.Messages, answer: str) -> float:
    """1 when the first reply is already the answer."""
    replies = parser.get_assistant_messages(completion)
    return float(bool(replies) and (replies[0].content or "").strip() == answer)


class CopyUntilRight(vf.MultiTurnEnv):
    """Asks again, telling the letter, until the reply is right (then a final "correct")."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        answer = state["answer"]
        if (messages[-1].content or "").strip() == answer:
            final = [vf.UserMessage(content="correct")]
            state["final_env_response"] = final
            return final
        return [vf.UserMessage(content=f"no, it is {answer}. copy: {answer}")]


def _copy_rows(num_examples: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    letters = [rng.choice(LETTERS) for _ in range(num_examples)]
    return Dataset.from_list([{"question": f"copy: {c}", "answer": c} for c in letters])


def _sum_rows(num_examples: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"{a}+{b}=?", "answer": str(a + b)})
    return Dataset.from_list(rows)


def load_environment(kind: str = "single", num_examples: int = 64, seed: int = 0,
                     system_prompt: str | None = None) -> vf.Environment:
    """The toy environment `kind` over `num_examples` rows drawn from `seed`, with an optional system prompt
    (module docstring)."""
    parser = vf.Parser()
    common = {"parser": parser, "system_prompt": system_prompt}
    if kind == "single":
        rubric = vf.Rubric(funcs=[exact, short], weights=[1.0, 0.2], parser=parser)
        return vf.SingleTurnEnv(dataset=_copy_rows(num_examples, seed), rubric=rubric, **common)
    if kind == "multi":
        rubric = vf.Rubric(funcs=[exact, first_try], weights=[1.0, 0.5], parser=parser)
        return CopyUntilRight(dataset=_copy_rows(num_examples, seed), rubric=rubric, max_turns=3, **common)
    if kind == "tool":
        rubric = vf.Rubric(funcs=[exact], weights=[1.0], parser=parser)
        return vf.ToolEnv(dataset=_sum_rows(num_examples, seed), tools=[add], rubric=rubric, max_turns=3,
                          **common)
    raise ValueError(f"kind must be 'single', 'multi' or 'tool', got {kind!r}")
