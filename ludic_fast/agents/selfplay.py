"""Two-player games: self-play (both seats the policy being trained) or one seat against a fixed opponent.

A `TwoPlayerGame` is `reset(seed)`, `to_move() -> seat`, `observation(seat) -> text` (what the seat is sent
at its turn), `legal_moves() -> [move]`, `play(seat, move)`, `resign(seat)`, `done()`, `rewards() -> (r0, r1)`.

- `SelfPlayRunner.run(jobs)`: every job's environment is a game; both seats are sampled from the same policy,
  and each seat's turns are its own token-exact episode (its own chat: the other seat's moves reach it only
  through its observations, built as `ludic_fast.agents.episode` builds any episode). A job gives two
  episodes (seat 0's, then seat 1's), each with the job's meta, its group id suffixed ":seat<k>" (so a GRPO
  group compares a seat's episodes of one seed with each other), and its seat's final reward on its last step.
  Each round samples one turn of every live game's seat to move, in one `sampler.generate` call. A turn cut by
  `max_new_tokens` (no stop token) resigns the game for its seat (its episode "truncated", reason
  "turn_length"); so does a seat whose episode would pass `max_tokens`; `max_turns` moves of one seat end the
  game as a draw (both episodes truncated, reason "max_turns"). The runner is a drop-in for `EpisodeRunner` in
  `EnvBatchSource` (`make_env` returns a game).
- `VersusEnv(game, opponent="random", seat=None)`: the fixed-opponent choice, an ordinary environment for
  `EpisodeRunner`: the model plays `seat` (default: the episode seed's parity, so evaluations cover both
  seats), the opponent `opponent(observation, legal_moves, rng) -> move` the other ("random": uniform over
  the legal moves, drawn from the episode seed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ludic_fast.agents.episode import ChatTokens, EpisodeTokens
from ludic_fast.agents.protocol import AssistantTurn, Message, StepResult
from ludic_fast.agents.runner import Episode, EpisodeJob
from ludic_fast.data.types import Rollout, Step, TokenTrace
from ludic_fast.rollout.sampler import SamplingConfig

Opponent = Callable[[str, list[str], random.Random], str]


@runtime_checkable
class TwoPlayerGame(Protocol):
    """A two-seat game (module docstring)."""

    def reset(self, seed: int) -> None: ...
    def to_move(self) -> int: ...
    def observation(self, seat: int) -> str: ...
    def legal_moves(self) -> list[str]: ...
    def play(self, seat: int, move: str) -> None: ...
    def resign(self, seat: int) -> None: ...
    def done(self) -> bool: ...
    def rewards(self) -> tuple[float, float]: ...


def random_opponent(observation: str, legal_moves: list[str], rng: random.Random) -> str:
    """A uniformly random legal move."""
    return rng.choice(legal_moves)


class VersusEnv:
    """`game` with the model as `seat` and `opponent` as the other seat (module docstring)."""

    def __init__(self, game: TwoPlayerGame, opponent: str | Opponent = "random", seat: int | None = None):
        if seat not in (None, 0, 1):
            raise ValueError(f"seat must be 0, 1 or None, got {seat!r}")
        if opponent == "random":
            opponent = random_opponent
        if not callable(opponent):
            raise TypeError(f"opponent must be 'random' or a function (observation, legal_moves, rng) -> move, "
                            f"got {opponent!r}")
        self.game, self.opponent, self.fixed_seat = game, opponent, seat
        self.seat, self.rng = 0, random.Random(0)

    def _to_my_turn(self) -> None:
        while not self.game.done() and self.game.to_move() != self.seat:
            other = self.game.to_move()
            self.game.play(other, self.opponent(self.game.observation(other), self.game.legal_moves(), self.rng))

    def reset(self, seed: int) -> list[Message]:
        self.game.reset(seed)
        self.seat = seed % 2 if self.fixed_seat is None else self.fixed_seat
        self.rng = random.Random(f"versus:{seed}")
        self._to_my_turn()
        if self.game.done():
            raise ValueError(f"the game (seed {seed}) ended before seat {self.seat} moved")
        return [{"role": "user", "content": self.game.observation(self.seat)}]

    def step(self, turn: AssistantTurn) -> StepResult:
        self.game.play(self.seat, turn.content or turn.text)
        self._to_my_turn()
        if self.game.done():
            return StepResult(reward=self.game.rewards()[self.seat], done=True, info={"seat": self.seat})
        return StepResult([{"role": "user", "content": self.game.observation(self.seat)}], info={"seat": self.seat})


@dataclass
class _Seat:
    episode: Episode
    chat: ChatTokens
    first: list[Message] = field(default_factory=list)
    last: Message | None = None


@dataclass
class _Game:
    job: EpisodeJob
    game: TwoPlayerGame
    seats: list[_Seat]
    ended: bool = False


class SelfPlayRunner:
    """Both seats of two-player games played by one policy (module docstring). sampler: `generate(prompts,
    sampling, seed=) -> [Completion]`; tokenizer with a chat template; stop_ids default to its eos."""

    def __init__(self, sampler: Any, tokenizer: Any, *, sampling: SamplingConfig | None = None,
                 max_turns: int | None = None, max_tokens: int = 512, max_new_tokens: int = 8,
                 stop_ids: Sequence[int] | None = None, template_kwargs: dict[str, Any] | None = None):
        for name, value in (("max_tokens", max_tokens), ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be a positive int or None, got {max_turns!r}")
        self.sampler, self.tokenizer = sampler, tokenizer
        self.max_turns, self.max_tokens, self.max_new_tokens = max_turns, max_tokens, max_new_tokens
        self.sampling = sampling or SamplingConfig(max_new_tokens=max_new_tokens)
        if stop_ids is None:
            if getattr(tokenizer, "eos_token_id", None) is None:
                raise ValueError("the tokenizer has no eos token: pass stop_ids")
            stop_ids = [tokenizer.eos_token_id]
        self.stop_ids = [int(t) for t in stop_ids]
        self.template_kwargs = dict(template_kwargs or {})

    def run_sync(self, jobs: Sequence[EpisodeJob], *, seed: int = 0) -> list[Episode]:
        return asyncio.run(self.run(jobs, seed=seed))

    def _new_game(self, job: EpisodeJob) -> _Game:
        if not isinstance(job.env, TwoPlayerGame):
            raise TypeError(f"SelfPlayRunner plays TwoPlayerGame environments, got {type(job.env).__name__}")
        seats = []
        for k in (0, 1):
            meta = {**job.meta, "env_seed": job.seed, "seat": k, "sampling_temperature": self.sampling.temperature,
                    "engine": {"return_spec": {"return_chosen_logprobs": True}}}
            if isinstance(meta.get("request_meta"), dict):
                meta["request_meta"] = dict(meta["request_meta"])
            for holder in (meta, meta.get("request_meta")):
                if isinstance(holder, dict) and holder.get("group_id") is not None:
                    holder["group_id"] = f"{holder['group_id']}:seat{k}"
            chat = ChatTokens(self.tokenizer, self.stop_ids, template_kwargs=self.template_kwargs)
            seats.append(_Seat(Episode(Rollout(meta=meta), EpisodeTokens(), []), chat))
        job.env.reset(job.seed)
        return _Game(job, job.env, seats)

    def _context(self, g: _Game, k: int) -> None:
        """The seat's observation at its turn into its episode (its first prompt, or the delta after its turn)."""
        seat = g.seats[k]
        obs = [{"role": "user", "content": g.game.observation(k)}]
        ep = seat.episode
        if not seat.first:
            seat.first = obs
            ep.tokens.add_context(seat.chat.prompt_ids(obs))
        else:
            ep.tokens.add_context(seat.chat.observation_ids(seat.first, seat.last, obs))
            ep.rollout.steps[-1].next_obs = obs
        ep.messages.extend(obs)

    def _finish(self, g: _Game, reason: dict[int, tuple[str, str | None]] | None = None) -> None:
        """Each seat's reward on its last step; statuses "done" unless `reason` says otherwise for a seat."""
        rewards = g.game.rewards()
        for k, seat in enumerate(g.seats):
            ep = seat.episode
            status, why = (reason or {}).get(k, ("done", None))
            if ep.rollout.steps:
                last = ep.rollout.steps[-1]
                last.reward = float(rewards[k])
                last.terminated, last.truncated = status == "done", status == "truncated"
                last.info = {**last.info, "seat": k}
            ep.end(status, why)
        g.ended = True

    async def run(self, jobs: Sequence[EpisodeJob], *, seed: int = 0) -> list[Episode]:
        """Play every job's game to its end; episodes [job 0 seat 0, job 0 seat 1, job 1 seat 0, ...]."""
        games = [self._new_game(job) for job in jobs]
        rounds = 0
        while True:
            movers: list[tuple[_Game, int]] = []
            for g in games:
                if g.ended:
                    continue
                if g.game.done():
                    self._finish(g)
                    continue
                k = g.game.to_move()
                if self.max_turns is not None and g.seats[k].episode.turns >= self.max_turns:
                    self._finish(g, {0: ("truncated", "max_turns"), 1: ("truncated", "max_turns")})
                    continue
                self._context(g, k)
                if len(g.seats[k].episode.tokens.ids) >= self.max_tokens:
                    g.game.resign(k)
                    self._finish(g, {k: ("truncated", "max_tokens")})
                    continue
                movers.append((g, k))
            if not movers:
                return [seat.episode for g in games for seat in g.seats]
            budgets = [min(self.max_new_tokens, self.max_tokens - len(g.seats[k].episode.tokens.ids))
                       for g, k in movers]
            sampling = dataclasses.replace(self.sampling, max_new_tokens=max(budgets))
            completions = self.sampler.generate([g.seats[k].episode.tokens.ids for g, k in movers], sampling,
                                                seed=random.Random(f"{seed}:{rounds}").getrandbits(63))
            rounds += 1
            for (g, k), c, b in zip(movers, completions, budgets, strict=True):
                finish = c.finish_reason if len(c.completion_ids) <= b else "length"
                self._move(g, k, list(c.completion_ids[:b]), list(c.logprobs[:b]), finish)

    def _move(self, g: _Game, k: int, ids: list[int], logprobs: list[float], finish: str) -> None:
        seat = g.seats[k]
        ep = seat.episode
        prompt = list(ep.tokens.ids)
        ep.tokens.add_turn(ids, logprobs, finish)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        seat.last = {"role": "assistant", "content": text.strip()}
        ep.messages.append(seat.last)
        ep.rollout.steps.append(Step(index=ep.turns, prev_obs=ep.messages[-2:-1], action=text, next_obs=[],
                                     reward=0.0, info={"cut": True} if finish == "length" else {},
                                     trace=TokenTrace(prompt, ids, logprobs, finish)))
        if finish == "length":  # no stop token: the seat cannot take another turn token-exactly
            g.game.resign(k)
            self._finish(g, {k: ("truncated", "turn_length")})
            return
        g.game.play(k, text.strip())
        if g.game.done():
            self._finish(g)


__all__ = ["Opponent", "TwoPlayerGame", "random_opponent", "VersusEnv", "SelfPlayRunner"]
