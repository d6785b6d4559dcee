"""Embedded environments (no download, CPU) the tiny embedded model can learn, with demonstrations for its
SFT warm-up.

- `GuessNumberEnv` (multi-turn, feedback after each guess): the secret is a number in [0, max_number] drawn
  from the seed; the model guesses, the environment answers "higher" or "lower"; reward 1 when a guess is
  right (then done), 0 otherwise; `max_turns` guesses. A guesser that ignores the feedback finds the secret
  in 4 guesses out of 10 with probability 1 - 0.9^4 ~ 0.34; bisection always does.
- `CalculatorEnv` (a tool task): "a*b=" with two-digit operands, which the tiny model cannot multiply; the
  tool `calc(e)` can. Reward 1 when the final answer (a turn without a tool call) is the product.

`demonstrations(n, seed)` gives n demonstrated conversations for the SFT warm-up: a `good_share` (default
half) follow the good policy (bisection / calling the tool), the others a poor one (guesses that ignore the
feedback / answering without the tool), so the warmed-up model plays both and RL has a reward gap to close.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ludic_fast.agents.protocol import AssistantTurn, Message, StepResult


def _check_share(share: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"good_share must lie in [0, 1], got {share}")


def _demonstrations(env: GuessNumberEnv | CalculatorEnv, n: int, seed: int) -> list[list[Message]]:
    """n demonstrations on seeds drawn from `seed`, each played well with probability `env.good_share`."""
    rng = random.Random(seed)
    return [env.demonstration(rng.randrange(2**31), rng.random() < env.good_share) for _ in range(n)]


@dataclass
class GuessNumberEnv:
    """Guess the secret in [0, max_number] with "higher" / "lower" feedback (module docstring)."""

    max_number: int = 9
    max_turns: int = 4
    good_share: float = 0.5

    def __post_init__(self) -> None:
        if self.max_number < 1 or self.max_turns < 1:
            raise ValueError(f"max_number and max_turns must be >= 1, got {self.max_number}, {self.max_turns}")
        _check_share(self.good_share)
        self.secret = 0

    def prompt(self) -> str:
        return f"guess 0-{self.max_number}:"

    def reset(self, seed: int) -> list[Message]:
        self.secret = random.Random(seed).randint(0, self.max_number)
        return [{"role": "user", "content": self.prompt()}]

    def feedback(self, guess: int | None) -> str:
        if guess is None:
            return "a number:"
        return "higher:" if guess < self.secret else "lower:"

    def step(self, turn: AssistantTurn) -> StepResult:
        text = turn.content.strip()
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, info={"secret": self.secret})
        return StepResult([{"role": "user", "content": self.feedback(guess)}], info={"secret": self.secret})

    def demonstration(self, env_seed: int, good: bool) -> list[Message]:
        """The conversation of episode `env_seed` played by bisection (good) or by guesses drawn at random."""
        rng = random.Random(env_seed)
        messages = self.reset(env_seed)
        lo, hi = 0, self.max_number
        for _ in range(self.max_turns):
            guess = (lo + hi) // 2 if good else rng.randint(0, self.max_number)
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == self.secret:
                break
            lo, hi = (guess + 1, hi) if guess < self.secret else (lo, guess - 1)
            messages.append({"role": "user", "content": self.feedback(guess)})
        if messages[-1]["role"] != "assistant":
            messages.pop()
        return messages

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """n conversations on seeds drawn from `seed`: a `good_share` of them bisect, the others guess at random."""
        return _demonstrations(self, n, seed)


def calc(e: str) -> str:
    """Compute an arithmetic expression of two integers.

    Args:
        e: the expression, e.g. 12*34 (operators + - *)
    """
    m = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", e)
    if m is None:
        return "error: expected <int><+|-|*><int>"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


@dataclass
class CalculatorEnv:
    """Multiply two numbers in [10, max_operand] with the `calc` tool (module docstring)."""

    max_operand: int = 99
    max_turns: int = 3
    good_share: float = 0.5

    def __post_init__(self) -> None:
        if self.max_operand < 10 or self.max_turns < 2:
            raise ValueError(f"need max_operand >= 10 and max_turns >= 2, got {self.max_operand}, {self.max_turns}")
        _check_share(self.good_share)
        self.tools = [calc]
        self.a = self.b = 0

    def reset(self, seed: int) -> list[Message]:
        rng = random.Random(seed)
        self.a, self.b = rng.randint(10, self.max_operand), rng.randint(10, self.max_operand)
        return [{"role": "user", "content": f"{self.a}*{self.b}="}]

    def step(self, turn: AssistantTurn) -> StepResult:
        correct = turn.content.strip() == str(self.a * self.b)
        return StepResult(reward=float(correct), done=True, info={"answer": self.a * self.b})

    def demonstration(self, env_seed: int, good: bool) -> list[Message]:
        """The conversation of episode `env_seed`: call the tool and copy its result (good), or guess a nearby
        number."""
        messages = self.reset(env_seed)
        product = self.a * self.b
        if good:
            call = {"type": "function", "function": {"name": "calc", "arguments": {"e": f"{self.a}*{self.b}"}}}
            return messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "name": "calc", "content": str(product)},
                               {"role": "assistant", "content": str(product)}]
        rng = random.Random(env_seed)
        guess = max(0, product + rng.choice([-1, 1]) * rng.randint(1, product // 10 + 1))
        return messages + [{"role": "assistant", "content": str(guess)}]

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """n conversations on seeds drawn from `seed`: a `good_share` of them use the tool, the others guess."""
        return _demonstrations(self, n, seed)


__all__ = ["GuessNumberEnv", "CalculatorEnv", "calc"]
