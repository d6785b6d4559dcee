"""textarena games as environments of `ludic_fast.agents` (reset(seed) -> messages, step(turn) -> StepResult).

textarena (https://github.com/LeonGuertler/TextArena, `pip install ludic-fast[textarena]`) games are stepped
turn by turn: `game.step(action) -> (done, info)`, `game.get_observation() -> (player, [(from, text, type)])`,
`game.close() -> (rewards, game_info)` at the end. `TextArenaEnv("TicTacToe-v0")` plays one of them:

- the model is player `player_id`; every other player is the fixed `opponent` policy ("random": a uniformly
  random legal move, `legal_moves()`; or your own `module:function`, `(observation, rng) -> action`);
- each observation is the messages the game sends the model since its last move (the game's own texts,
  another player's move as "[Player k] move"; the model's own move is already its turn), one user message;
- an invalid move is answered as the game answers it: the game's message (it asks again, up to its error
  allowance) or the game's end with the game's penalty;
- rewards: textarena games report them when they end (`close()`): the model's reward is the last step's;
  earlier steps get 0 and the game's step info (`info["textarena"]`).

Legal moves: textarena has no common legal-move API, so `legal_moves()` tries candidates on a copy of the game
and keeps those the game accepts (its own rules decide: a candidate it answers with `set_invalid_move` is out).
Candidates: every bracketed move in the texts the player has been sent ('[4]', '[hit]'), the same shapes with
their one or two numbers replaced by 0-9 ('[0 3]' -> '[2 1]'), and the moves of `MOVE_GENERATORS` for games
whose moves the texts do not spell (TowerOfHanoi, Chopsticks). A game where none is accepted is refused in one
line naming it (docs/environments.md lists those games).

The game is built without textarena's observation wrappers (its "-raw" version; a "-train" id plays its game's):
the chat template renders the conversation. textarena seeds and draws from Python's global `random` (a few games
from numpy's): each episode keeps its own states of both (`ludic_fast.agents.own_random`), installed around every
call into its game, so a seed gives the game textarena plays alone with that seed, whatever else runs.
"""

from __future__ import annotations

import copy
import itertools
import random
import re
import sys
from collections.abc import Callable
from typing import Any

from ludic_fast.agents.libraries import import_library
from ludic_fast.agents.own_random import OwnRandomState
from ludic_fast.agents.protocol import AssistantTurn, Message, StepResult

_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
_NUMBERED = re.compile(r"\[\s*(\d+)(\s*,?\s*)(\d+)?\s*\]")

Opponent = Callable[[str, random.Random], str]

#: moves of games whose texts do not spell them, by the game's name (the id before "-v")
MOVE_GENERATORS: dict[str, Callable[[Any], list[str]]] = {
    "TowerOfHanoi": lambda game: [f"[{a} {b}]" for a, b in itertools.permutations("ABC", 2)],
    "Chopsticks": lambda game: [f"[attack {i} {j}]" for i in (0, 1) for j in (0, 1)]
    + [f"[split {a} {b}]" for a in range(5) for b in range(5)],
}


def _ta() -> Any:
    return import_library("textarena", "textarena", "textarena games")


def candidate_moves(text: str) -> list[str]:
    """The bracketed moves in `text`, then each one- or two-number shape with its numbers replaced by 0-9."""
    seen = list(dict.fromkeys(_BRACKETED.findall(text)))
    out = list(seen)
    for move in seen:
        m = _NUMBERED.fullmatch(move)
        if m is None:
            continue
        if m.group(3) is None:
            out += [f"[{a}]" for a in range(10)]
        else:
            out += [f"[{a}{m.group(2)}{b}]" for a in range(10) for b in range(10)]
    return list(dict.fromkeys(out))


def render(messages: list[tuple[int, str, Any]], player_id: int) -> str:
    """One observation text of textarena messages (the player's own moves left out: they are its turns)."""
    ta = _ta()
    parts = []
    for from_id, text, kind in messages:
        if kind == ta.ObservationType.PLAYER_ACTION:
            if from_id == player_id:
                continue
            text = f"[Player {from_id}] {text}"
        parts.append(str(text).strip())
    return "\n\n".join(p for p in parts if p)


def _raw_id(game: str) -> str:
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        close = sorted(g for g in ENV_REGISTRY if g.split("-")[0].lower() == game.split("-")[0].lower())
        raise ValueError(f"textarena has no game {game!r}" + (f"; did you mean {', '.join(close[:6])}?" if close
                                                               else " (ids look like 'TicTacToe-v0')"))
    base = game.removesuffix("-train")  # textarena's training variant: the same game behind its text wrappers
    return f"{base}-raw" if f"{base}-raw" in ENV_REGISTRY else game


def _global_states() -> tuple[Any, Any]:
    """The states of `random` and, when numpy is imported, numpy's global generator."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state() if np is not None else None)


def _set_global_states(states: tuple[Any, Any]) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1])


def _accepts(game: Any, move: str) -> bool:
    """Whether `game` takes `move` without calling it invalid (played on a copy; the game is untouched)."""
    trial = copy.deepcopy(game)
    flagged: list[str] = []
    invalid = trial.state.set_invalid_move

    def spy(*args: Any, **kwargs: Any) -> Any:
        flagged.append("invalid")
        return invalid(*args, **kwargs)

    trial.state.set_invalid_move = spy
    try:
        trial.step(move)
    except Exception:  # noqa: BLE001 - a candidate the game cannot parse is not a legal move
        return False
    return not flagged


class TextArenaEnv:
    """One textarena game per episode, the model as `player_id` against `opponent` (module docstring).

    num_players: the game's player count (default: 1 when the game accepts one, else 2); max_turns: the
    model's moves per episode (the runner's limit when it sets none; demonstrations stop there too);
    game_kwargs go to `textarena.make` (the game's own options). `moves`: every action this episode sent to the
    game, the model's and the opponents', in order (textarena replays the game from its seed and these)."""

    def __init__(self, game: str, *, opponent: str | Opponent = "random", player_id: int = 0,
                 num_players: int | None = None, max_turns: int | None = None, **game_kwargs: Any):
        _ta()
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        self.max_turns = max_turns
        self.game_id, self.raw_id = game, _raw_id(game)
        self.opponent = self._opponent(opponent)
        self.game_kwargs = game_kwargs
        self.random_state = OwnRandomState(0)
        self.num_players = num_players or self._default_players()
        if not 0 <= player_id < self.num_players:
            raise ValueError(f"player_id must lie in [0, {self.num_players}) for {game}, got {player_id}")
        self.player_id = player_id
        self.game: Any = None
        self.rng = random.Random(0)
        self.sent: dict[int, list[str]] = {}
        self.moves: list[str] = []

    def _opponent(self, spec: str | Opponent) -> Opponent:
        if callable(spec):
            return spec
        if spec == "random":
            return lambda observation, rng: rng.choice(self._legal_moves())
        from ludic_fast.registry import load_attr

        fn = load_attr(spec, "opponent")
        if not callable(fn):
            raise TypeError(f"opponent {spec!r} is not callable")
        return fn

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

    def legal_moves(self) -> list[str]:
        """The current player's legal moves (module docstring), ValueError naming the game when it has none."""
        if self.game is None:
            raise RuntimeError("legal_moves before reset")
        with self.random_state:
            return self._legal_moves()

    def _legal_moves(self) -> list[str]:
        """legal_moves inside the episode's random state; the trials leave the generators as they found them."""
        player = self.game.state.current_player_id
        generate = MOVE_GENERATORS.get(self.game_id.split("-v")[0])
        candidates = candidate_moves("\n".join(self.sent.get(player, [])))
        candidates += [m for m in (generate(self.game) if generate else []) if m not in candidates]
        states = _global_states()
        try:
            legal = [m for m in candidates if _accepts(self.game, m)]
        finally:
            _set_global_states(states)
        if not legal:
            raise ValueError(f"textarena game {self.game_id}: no legal move found for player {player} (its texts "
                             "list none the game accepts and ludic_fast has no move generator for it); "
                             "pass opponent='module:function' (observation, rng) -> move")
        return legal

    def _observe(self) -> tuple[int, str]:
        player, messages = self.game.get_observation()
        text = render(messages, player)
        self.sent.setdefault(player, []).append(text)
        return player, text

    def reset(self, seed: int) -> list[Message]:
        """A new game of `seed` (the opponent's moves are drawn from `seed` too), played up to the model's turn."""
        self.rng = random.Random(f"textarena-opponent:{seed}")
        self.random_state = OwnRandomState(seed)
        self.sent, self.moves = {}, []
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
            player, text = self._observe()
            if player == self.player_id:
                return False, text
            move = self.opponent(text, self.rng)
            self.moves.append(move)
            done, _ = self.game.step(move)
            if done:
                pending = self.game.state.observations.get(self.player_id, [])
                return True, render(pending, self.player_id)

    def step(self, turn: AssistantTurn) -> StepResult:
        """The model's move (its turn's text) to the game, then the opponents' moves (module docstring)."""
        if self.game is None:
            raise RuntimeError("step before reset")
        move = turn.content or turn.text
        self.moves.append(move)
        with self.random_state:
            done, info = self.game.step(move)
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
        """n games on seeds drawn from `seed` with the model's moves drawn uniformly from `legal_moves()` (up to
        max_turns moves): the SFT warm-up's conversations (they teach the move format, not good play)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            game_seed = rng.randrange(2**31)
            messages = list(self.reset(game_seed))
            mover = random.Random(f"textarena-demo:{game_seed}")
            while True:
                move = mover.choice(self.legal_moves())
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


__all__ = ["MOVE_GENERATORS", "Opponent", "TextArenaEnv", "candidate_moves", "make_env", "render"]
