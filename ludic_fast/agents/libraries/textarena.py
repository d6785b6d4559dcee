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
Candidates: for a game of `MOVE_GENERATORS`, moves built from the game's state (its board, hand, grid or its own
valid-move list; where the moves are too many to list, a uniform draw of `SAMPLED` of them, seeded by the episode
seed and the moves so far); for any other game, every bracketed move in the texts the player has been sent ('[4]',
'[hit]'), and the same shapes with their one or two numbers replaced by 0-9 ('[0 3]' -> '[2 1]'). A game where none
is accepted is refused in one line naming it.

The game is built without textarena's observation wrappers (its "-raw" version; a "-train" id plays its game's):
the chat template renders the conversation. textarena seeds and draws from Python's global `random` (a few games
from numpy's): each episode keeps its own states of both (`ludic_fast.agents.own_random`), installed around every
call into its game, so a seed gives the game textarena plays alone with that seed, whatever else runs.
"""

from __future__ import annotations

import copy
import itertools
import math
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

#: how many moves `legal_moves()` draws for a game whose moves are too many to list (a code, an allocation)
SAMPLED = 64
_KING = [(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if dr or dc]  # the eight directions on a board
_ROOK = [(-1, 0), (1, 0), (0, -1), (0, 1)]


def _cells(board: list[list[Any]], wanted: Any) -> list[tuple[int, int]]:
    """(row, col) of every cell of `board` (a list of rows) equal to `wanted`."""
    return [(r, c) for r, row in enumerate(board) for c, cell in enumerate(row) if cell == wanted]


def _algebraic(col: int, rank: int) -> str:
    return f"{chr(ord('a') + col)}{rank}"


def _from_to(board: list[list[Any]], piece: Any, targets: Callable[[int, int], list[tuple[int, int]]],
             name: Callable[[int, int], str], sep: str = "") -> list[str]:
    """'[FROM{sep}TO]' for every cell of `piece` and each of its `targets(row, col)` that lies on the board."""
    n, m = len(board), len(board[0])
    return [f"[{name(r, c)}{sep}{name(tr, tc)}]" for r, c in _cells(board, piece)
            for tr, tc in targets(r, c) if 0 <= tr < n and 0 <= tc < m]


def _distinct(draw: Callable[[], str]) -> list[str]:
    """SAMPLED draws of `draw()`, repeats dropped: a uniform sample of a move set too large to list."""
    return list(dict.fromkeys(draw() for _ in range(SAMPLED)))


def _player(game: Any) -> int:
    return game.state.current_player_id


def _alquerque(game: Any, rng: random.Random) -> list[str]:
    """A step or a jump (two squares) in any direction; the game keeps the forward steps and the captures."""
    return _from_to(game.state.game_state["board"], "RB"[_player(game)],
                    lambda r, c: [(r + k * dr, c + k * dc) for dr, dc in _KING for k in (1, 2)],
                    lambda r, c: _algebraic(c, game.BOARD_N - r), sep=" ")


def _breakthrough(game: Any, rng: random.Random) -> list[str]:
    forward = 1 if _player(game) == 0 else -1  # row 0 is rank 1, White's home row
    return _from_to(game.state.game_state["board"], "WB"[_player(game)],
                    lambda r, c: [(r + forward, c + dc) for dc in (-1, 0, 1)], lambda r, c: _algebraic(c, r + 1))


def _lines_of_action(game: Any, rng: random.Random) -> list[str]:
    """Along each line, as far as the line holds pieces (the game's own count)."""
    def targets(r: int, c: int) -> list[tuple[int, int]]:
        return [(r + dr * k, c + dc * k) for dr, dc in _KING if (k := game._count_pieces_on_line(r, c, dr, dc))]

    return _from_to(game.state.game_state["board"], "OX"[_player(game)], targets,
                    lambda r, c: _algebraic(c, game.BOARD_N - r))


def _tak(game: Any, rng: random.Random) -> list[str]:
    """Placements (flat, wall, capstone) on empty squares and moves of the top k pieces of one's stacks to a
    neighbouring square; a stack split over several squares is not listed."""
    pid, board = _player(game), game.board
    place = [f"[place () {{({r},{c}): [{kind}{pid}]}}]" for r, c in _cells(board, []) for kind in "FWC"]
    move = [f"[move ({r},{c}) {{({r + dr},{c + dc}): [{', '.join(stack[-k:])}]}}]"
            for r, row in enumerate(board) for c, stack in enumerate(row) if stack and stack[-1].endswith(str(pid))
            for k in range(1, len(stack) + 1) for dr, dc in _ROOK
            if 0 <= r + dr < game.board_size and 0 <= c + dc < game.board_size]
    return place + move


def _othello(game: Any, rng: random.Random) -> list[str]:
    """The game's own valid moves; with none, any move passes the turn."""
    return [f"[{r}, {c}]" for r, c in game.state.game_state["valid_moves"]] or ["[pass]"]


def _battleship(game: Any, rng: random.Random) -> list[str]:
    """The squares not yet fired at."""
    return [f"[{chr(ord('A') + r)}{c}]" for r, c in _cells(game.state.game_state["tracking_board"][_player(game)], "~")]


def _sudoku(game: Any, rng: random.Random) -> list[str]:
    """The game calls a wrong number invalid: an empty cell's one legal number is the solution's."""
    return [f"[{r + 1} {c + 1} {n}]" for r, c in _cells(game.state.game_state["board"], 0) for n in range(1, 10)
            if game._is_move_correct(r, c, n)]


def _crosswords(game: Any, rng: random.Random) -> list[str]:
    """The game calls a wrong letter invalid: an empty cell's one legal letter is the solution's."""
    gs = game.state.game_state
    return [f"[{r} {c} {gs['solution'][r][c]}]" for r, c in _cells(gs["board"], "_")]


def _logic_puzzle(game: Any, rng: random.Random) -> list[str]:
    return [f"[{row} {col} {mark}]" for grid in game.game_board.values() for row, marks in grid.items()
            for col, have in marks.items() for mark in "OX" if have != mark]


def _mastermind(game: Any, rng: random.Random) -> list[str]:
    gs = game.state.game_state
    draw = rng.choices if gs["duplicate_numbers"] else rng.sample
    return _distinct(lambda: "[" + " ".join(map(str, draw(range(1, gs["num_numbers"] + 1), k=gs["code_length"]))) + "]")


def _colonel_blotto(game: Any, rng: random.Random) -> list[str]:
    """Allocations of all units, drawn uniformly (stars and bars: n - 1 bars among units + n - 1 places)."""
    n, units = len(game.field_names), game.num_total_units

    def draw() -> str:
        bars = [0, *sorted(rng.sample(range(1, units + n), n - 1)), units + n]
        return "[" + " ".join(f"{f}{b - a - 1}" for f, a, b in zip(game.field_names, bars, bars[1:])) + "]"

    return _distinct(draw)


def _new_recruit(game: Any, rng: random.Random) -> list[str]:
    letters = [sorted(game.choice_letters[issue]) for issue in game.issues]
    return ["[Accept]", "[Reject]"] + _distinct(lambda: "[Propose] " + "".join(rng.choice(x) for x in letters))


def _two_dollar(game: Any, rng: random.Random) -> list[str]:
    """Proposals in whole cents."""
    cents = round(game.total_amount * 100)
    return ["[Accept]", "[Reject]"] + [f"[Propose] ${c / 100:.2f}" for c in range(cents + 1)]


def _golf(game: Any, rng: random.Random) -> list[str]:
    return ["[draw]", "[take]", "[discard]", "[knock]"] + [
        f"[{verb} {r} {c}]" for verb in ("swap", "peek")
        for r in range(1, game.num_rows + 1) for c in range(1, game.num_columns + 1)]


def _play_card(game: Any, rng: random.Random) -> list[str]:
    """Trick-taking games: '[play i]', i a card's place in the hand."""
    hand = game.state.game_state["players"][_player(game)]["hand"]
    return [f"[play {i}]" for i in range(1, len(hand) + 1)]


#: moves of games whose texts do not spell them, by the game's name (the id before "-v"): `(game, rng) ->
#: moves`, the game's own rules filter them (`legal_moves`); `rng` draws the sampled ones (`SAMPLED`)
MOVE_GENERATORS: dict[str, Callable[[Any, random.Random], list[str]]] = {
    "TowerOfHanoi": lambda game, rng: [f"[{a} {b}]" for a, b in itertools.permutations("ABC", 2)],
    "Chopsticks": lambda game, rng: [f"[attack {i} {j}]" for i in (0, 1) for j in (0, 1)]
    + [f"[split {a} {b}]" for a in range(5) for b in range(5)],
    "Alquerque": _alquerque,
    "Bandit": lambda game, rng: [f"[{b}]" for b in game.buttons],
    "Battleship": _battleship,
    "Breakthrough": _breakthrough,
    "Briscola": _play_card,
    "ColonelBlotto": _colonel_blotto,
    "Crosswords": _crosswords,
    "Cryptarithm": lambda game, rng: [f"[{x} {d}]" for x in sorted(game.letters) for d in range(10)],
    "GermanWhist": _play_card,
    "Golf": _golf,
    "IteratedTwoThirdsAverage": lambda game, rng: [
        f"[{g}]" for g in range(math.ceil(game.min_guess), math.floor(game.max_guess) + 1)],
    "LightsOut": lambda game, rng: [f"[{r} {c}]" for r in range(game.size) for c in range(game.size)],
    "LinesOfAction": _lines_of_action,
    "LogicPuzzle": _logic_puzzle,
    "Mastermind": _mastermind,
    "NewRecruit": _new_recruit,
    "Othello": _othello,
    "PegJump": lambda game, rng: [f"[{f} {t}]" for f, _, t in game.ALLOWED_MOVES],
    "SantoriniBaseFixed": lambda game, rng: [m for m in game._get_valid_moves(_player(game)).split(", ") if m],
    "Slitherlink": lambda game, rng: [f"[h {r} {c}]" for r in range(game.R + 1) for c in range(game.C)]
    + [f"[v {r} {c}]" for r in range(game.R) for c in range(game.C + 1)],
    "Sudoku": _sudoku,
    "Tak": _tak,
    "TruthAndDeception": lambda game, rng: ["[Fact 1]", "[Fact 2]"],  # any text while they talk; these at the guess
    "TwoDollar": _two_dollar,
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
    """Whether `game` takes `move` without calling it invalid (played on a copy; the game is untouched). The copy
    starts an empty `state.logs` (textarena appends every message there and never reads it back): the log grows
    with the game and made each late-game trial ~4 ms (Tak after 150 moves)."""
    trial = copy.deepcopy(game, {id(game.state.logs): []})
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
        self.seed = 0
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
        if generate is not None:  # drawn from the episode seed and the moves so far: the same list at the same point
            candidates = generate(self.game, random.Random(f"textarena-moves:{self.seed}:{len(self.moves)}"))
        else:
            candidates = candidate_moves("\n".join(self.sent.get(player, [])))
        states = _global_states()
        try:
            legal = [m for m in candidates if _accepts(self.game, m)]
        finally:
            _set_global_states(states)
        if not legal:
            why = ("its move generator found none the game accepts" if generate is not None else
                   "its texts list none the game accepts and ludic_fast has no move generator for it")
            raise ValueError(f"textarena game {self.game_id}: no legal move found for player {player} ({why}); "
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
        self.seed = seed
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
