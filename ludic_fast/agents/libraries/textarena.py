"""textarena games as environments of `ludic_fast.agents` (reset(seed) -> messages, step(turn) -> StepResult).

textarena (https://github.com/LeonGuertler/TextArena, `pip install ludic-fast[textarena]`) games are stepped
turn by turn: `game.step(action) -> (done, info)`, `game.get_observation() -> (player, [(from, text, type)])`,
`game.close() -> (rewards, game_info)` at the end. `TextArenaEnv("TicTacToe-v0")` plays one of them:

- the model is player `player_id`; every other player is the fixed `opponent` policy, `opponent(observation,
  rng) -> action` ("random": a uniformly random move among those the game lists as available, `'[4]'` in
  quotes, as its board games print them; a game that lists none needs an opponent of your own, `module:function`);
- each observation is the messages the game sends the model since its last move (the game's own texts,
  another player's move as "[Player k] move"; the model's own move is already its turn), one user message;
- an invalid move is answered as the game answers it: the game's message (it asks again, up to its error
  allowance) or the game's end with the game's penalty;
- rewards: textarena games report them when they end (`close()`): the model's reward is the last step's;
  earlier steps get 0 and the game's step info (`info["textarena"]`).

The game is built without textarena's observation wrappers (its "-raw" version): the chat template renders the
conversation. textarena seeds and draws from Python's global `random` (a few games from numpy's), and episodes
run in threads: every call into an episode's game runs inside that episode's own random state
(`ludic_fast.agents.own_random`), so a seed gives the game textarena plays alone with that seed, whatever
else runs.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from ludic_fast.agents.libraries import import_library
from ludic_fast.agents.own_random import OwnRandomState
from ludic_fast.agents.protocol import AssistantTurn, Message, StepResult

_QUOTED_MOVE = re.compile(r"'(\[[^\]'\n]+\])'")

Opponent = Callable[[str, random.Random], str]


def _ta() -> Any:
    return import_library("textarena", "textarena", "textarena games")


def random_legal_move(observation: str, rng: random.Random) -> str:
    """A uniformly random move among the last list of quoted moves ('[4]', '[bet]') in `observation`."""
    for line in reversed(observation.splitlines()):
        moves = _QUOTED_MOVE.findall(line)
        if moves:
            return rng.choice(moves)
    raise ValueError("the game lists no available moves ('[move]' in quotes) for the random opponent; "
                     "pass opponent='module:function' (observation, rng) -> move")


OPPONENTS: dict[str, Opponent] = {"random": random_legal_move}


def _opponent(spec: str | Opponent) -> Opponent:
    if callable(spec):
        return spec
    if spec in OPPONENTS:
        return OPPONENTS[spec]
    from ludic_fast.registry import load_attr

    fn = load_attr(spec, "opponent")
    if not callable(fn):
        raise TypeError(f"opponent {spec!r} is not callable")
    return fn


def render(messages: list[tuple[int, str, Any]], player_id: int) -> str:
    """One observation text of textarena messages (the player's own moves left out: they are its turns)."""
    ta = _ta()
    parts = []
    for from_id, text, kind in messages:
        if kind == ta.ObservationType.PLAYER_ACTION:
            if from_id == player_id:
                continue
            text = f"[Player {from_id}] {text}"
        parts.append(text.strip())
    return "\n\n".join(p for p in parts if p)


def _raw_id(game: str) -> str:
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        close = sorted(g for g in ENV_REGISTRY if g.split("-")[0].lower() == game.split("-")[0].lower())
        raise ValueError(f"textarena has no game {game!r}" + (f"; did you mean {', '.join(close[:6])}?" if close
                                                               else " (ids look like 'TicTacToe-v0')"))
    return f"{game}-raw" if f"{game}-raw" in ENV_REGISTRY else game


class TextArenaEnv:
    """One textarena game per episode, the model as `player_id` against `opponent` (module docstring).

    num_players: the game's player count (default: 1 when the game accepts one, else 2); max_turns: the
    model's moves per episode (the runner's limit when it sets none; demonstrations stop there too);
    game_kwargs go to `textarena.make` (the game's own options)."""

    def __init__(self, game: str, *, opponent: str | Opponent = "random", player_id: int = 0,
                 num_players: int | None = None, max_turns: int | None = None, **game_kwargs: Any):
        _ta()
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        self.max_turns = max_turns
        self.game_id, self.raw_id = game, _raw_id(game)
        self.opponent = _opponent(opponent)
        self.game_kwargs = game_kwargs
        self.num_players = num_players or self._default_players()
        if not 0 <= player_id < self.num_players:
            raise ValueError(f"player_id must lie in [0, {self.num_players}) for {game}, got {player_id}")
        self.player_id = player_id
        self.game: Any = None
        self.rng = random.Random(0)
        self.random_state = OwnRandomState(0)

    def _default_players(self) -> int:
        for n in (1, 2):
            try:
                with OwnRandomState(0):
                    self._make().reset(num_players=n, seed=0)
                return n
            except (AssertionError, ValueError, KeyError, IndexError):
                continue
        raise ValueError(f"textarena game {self.game_id} plays neither 1 nor 2 players: pass num_players")

    def _make(self) -> Any:
        try:
            return _ta().make(self.raw_id, **self.game_kwargs)
        except TypeError as exc:
            raise ValueError(f"textarena game {self.game_id} with {self.game_kwargs}: {exc}") from None

    def reset(self, seed: int) -> list[Message]:
        """A new game of `seed` (the opponent's moves are drawn from `seed` too), played up to the model's turn."""
        self.rng = random.Random(f"textarena-opponent:{seed}")
        self.random_state = OwnRandomState(seed)
        with self.random_state:
            self.game = self._make()
            self.game.reset(num_players=self.num_players, seed=seed)
            done, text = self._to_my_turn()
        if done:
            raise ValueError(f"textarena game {self.game_id} (seed {seed}) ended before player {self.player_id} moved")
        return [{"role": "user", "content": text}]

    def _to_my_turn(self) -> tuple[bool, str]:
        """Opponents move until it is the model's turn or the game ends: (done, what the model has been sent)."""
        while True:
            player, messages = self.game.get_observation()
            if player == self.player_id:
                return False, render(messages, self.player_id)
            done, _ = self.game.step(self.opponent(render(messages, player), self.rng))
            if done:
                pending = self.game.state.observations.get(self.player_id, [])
                return True, render(pending, self.player_id)

    def step(self, turn: AssistantTurn) -> StepResult:
        """The model's move (its turn's text) to the game, then the opponents' moves (module docstring)."""
        if self.game is None:
            raise RuntimeError("step before reset")
        with self.random_state:
            done, info = self.game.step(turn.content or turn.text)
            text = ""
            if not done:
                done, text = self._to_my_turn()
            if not done:
                return StepResult([{"role": "user", "content": text}], reward=0.0,
                                  info={"textarena": dict(info or {})})
            rewards, game_info = self.game.close()
        mine = (game_info or {}).get(self.player_id, {})
        return StepResult(reward=float((rewards or {}).get(self.player_id, 0.0)), done=True,
                          info={"textarena": {**dict(info or {}), **mine}})

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """n games on seeds drawn from `seed` with the model's moves made by the random legal-move policy (up to
        max_turns moves): the SFT warm-up's conversations (they teach the move format, not good play)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            game_seed = rng.randrange(2**31)
            messages = list(self.reset(game_seed))
            mover = random.Random(f"textarena-demo:{game_seed}")
            while True:
                move = random_legal_move(messages[-1]["content"], mover)
                messages.append({"role": "assistant", "content": move})
                result = self.step(AssistantTurn(move, [], content=move))
                if result.done or len(messages) // 2 == self.max_turns:
                    break
                messages.extend(result.observations)
            out.append(messages)
        return out


def make_env(game: str, opponent: str = "random", player_id: int = 0, max_turns: int | None = None,
             **game_kwargs: Any) -> TextArenaEnv:
    """The `--env` factory: `--env ludic_fast.agents.libraries.textarena:make_env --env-arg game=TicTacToe-v0`."""
    return TextArenaEnv(game, opponent=opponent, player_id=player_id, max_turns=max_turns, **game_kwargs)


__all__ = ["OPPONENTS", "Opponent", "TextArenaEnv", "make_env", "random_legal_move", "render"]
