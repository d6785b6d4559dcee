"""Every registered single- and two-player textarena game: built, reset, a few random legal moves (the warm-up's
and the random opponent's policy, `TextArenaEnv.legal_moves`), and the rewards equal to textarena's own replay of
the same seed and moves; a game without legal moves is refused in one line naming it, and the games that do not
play are exactly those docs/environments.md lists."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

ta = pytest.importorskip("textarena", reason="textarena is not installed (pip install 'ludic-fast[textarena]')")

from textarena.envs.registration import ENV_REGISTRY  # noqa: E402

from ludic_fast.agents.libraries.textarena import (  # noqa: E402
    MOVE_GENERATORS,
    SAMPLED,
    TextArenaEnv,
    candidate_moves,
)
from ludic_fast.agents.protocol import AssistantTurn  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "environments.md"
#: "-train" ids play their game's "-raw" version; Sokoban-v0-medium's reset alone takes ~1 min (puzzle search)
SLOW = {"Sokoban-v0-medium"}
GAMES = sorted(g for g in ENV_REGISTRY if not g.endswith(("-raw", "-train")) and g not in SLOW)
MOVES = 2  # model moves per game: the sweep must stay fast
#: what a game that cannot be built here raises (missing package or data, an API key, a player count not 1 or 2)
NOT_BUILT = (ImportError, LookupError, SyntaxError, OSError, ValueError, AssertionError, KeyError, TypeError)


def play(game: str, seed: int = 1, moves: int = MOVES) -> tuple[str, str]:
    """(status, detail): "plays" (no move drawn from legal_moves() called invalid by the game, and the rewards equal
    textarena's replay), "refused" (no legal move) or "not built"."""
    try:
        env = TextArenaEnv(game, max_turns=moves)
        first = env.reset(seed)
    except NOT_BUILT as exc:
        return "not built", f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    played, invalid = env.game.state, []
    original = type(played).set_invalid_move

    def spy(state, *args, **kwargs):  # the game's own verdict on the moves played (trials run on copies)
        if state is played:
            invalid.append(args or kwargs)
        return original(state, *args, **kwargs)

    mover, rewards, done = random.Random(seed), [], False
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(played), "set_invalid_move", spy)
        try:
            for _ in range(moves):
                move = mover.choice(env.legal_moves())
                r = env.step(AssistantTurn(move, [], content=move))
                rewards.append(r.reward)
                if r.done:
                    done = True
                    break
        except ValueError as exc:
            if not str(exc).startswith(f"textarena game {game}: no legal move"):
                raise
            return "refused", f"after {len(rewards)} moves"
    assert not invalid, (game, env.moves, invalid)
    assert first[0]["content"]
    alone = ta.make(env.raw_id)  # textarena on its own: the same seed and the same moves
    alone.reset(num_players=env.num_players, seed=seed)
    over = False
    for m in env.moves:
        over, _ = alone.step(m)
        if over:
            break
    theirs = float(alone.close()[0][env.player_id]) if over else 0.0
    assert (done, rewards[-1]) == (over, theirs), game
    return "plays", f"{len(rewards)} moves, {'ended' if done else 'not ended'}, reward {rewards[-1]:g}"


def documented_not_playing() -> set[str]:
    """The games docs/environments.md lists as not playable (its table of games that do not play)."""
    text = DOCS.read_text()
    table = text.split("<!-- textarena-not-playing -->")[1].strip().split("\n\n")[0]  # up to its first blank line
    return set(re.findall(r"^\| `([^`]+)` \|", table, flags=re.M))


def test_every_game_plays_or_is_refused_and_the_docs_list_the_ones_that_do_not():
    rows = {g: play(g) for g in GAMES}
    not_playing = {g for g, (status, _) in rows.items() if status != "plays"}
    assert sum(status == "plays" for status, _ in rows.values()) >= 100
    assert not_playing == documented_not_playing(), sorted(not_playing ^ documented_not_playing())


#: games played to their end: textarena's reward for it, from the state's moves (Tak left out: its stacks grow,
#: and a whole random game takes minutes of trials)
WHOLE = ("Alquerque-v0", "Bandit-v0", "Battleship-v0", "Breakthrough-v0-tiny", "Briscola-v0", "ColonelBlotto-v0-small",
         "Crosswords-v0", "Cryptarithm-v0", "GermanWhist-v0", "Golf-v0", "IteratedTwoThirdsAverage-v0", "LightsOut-v0",
         "LogicPuzzle-v0", "Mastermind-v0", "NewRecruit-v0", "Othello-v0-hard", "PegJump-v0", "SantoriniBaseFixed-v0",
         "Sudoku-v0-very-easy", "TruthAndDeception-v0", "TwoDollar-v0")


def test_whole_games_of_the_move_generators_end_with_textarenas_rewards():
    rows = {g: play(g, moves=400) for g in WHOLE}
    assert all(status == "plays" and ", ended," in detail for status, detail in rows.values()), rows
    rewards = {float(detail.rsplit(" ", 1)[1]) for _, detail in rows.values()}
    assert {-1.0, 0.0, 1.0} < rewards, rows  # losses, draws, wins and partial credit


def _every(game: str) -> list[str]:
    """Every move of the game's format within its board (brute force, for the generators' completeness)."""
    if game == "Alquerque-v0":
        squares = [f"{f}{r}" for f in "abcde" for r in range(1, 6)]
        return [f"[{a} {b}]" for a in squares for b in squares]
    if game in ("Breakthrough-v0-small", "LinesOfAction-v0"):
        n = 6 if game.startswith("Breakthrough") else 8
        squares = [f"{chr(ord('a') + f)}{r}" for f in range(n) for r in range(1, n + 1)]
        return [f"[{a}{b}]" for a in squares for b in squares]
    if game == "Othello-v0-hard":
        return [f"[{r}, {c}]" for r in range(8) for c in range(8)]
    if game == "PegJump-v0":
        return [f"[{a} {b}]" for a in range(1, 16) for b in range(1, 16)]
    if game == "Sudoku-v0":
        return [f"[{r} {c} {n}]" for r in range(1, 10) for c in range(1, 10) for n in range(1, 10)]
    assert game == "Battleship-v0"
    return [f"[{chr(ord('A') + r)}{c}]" for r in range(5) for c in range(5)]


@pytest.mark.parametrize("game", ["Alquerque-v0", "Battleship-v0", "Breakthrough-v0-small", "LinesOfAction-v0",
                                  "Othello-v0-hard", "PegJump-v0", "Sudoku-v0"])
def test_a_board_games_generator_lists_every_legal_move(game, monkeypatch):
    """At the start and after three random moves: the generator's moves are the moves of the whole format the game
    accepts, nothing missing, nothing extra."""
    env = TextArenaEnv(game)
    env.reset(2)
    name = game.split("-v")[0]
    mover = random.Random(0)
    for _ in range(4):
        listed = env.legal_moves()
        with monkeypatch.context() as patch:
            patch.setitem(MOVE_GENERATORS, name, lambda g, rng: _every(game))
            assert sorted(listed) == sorted(env.legal_moves()), game
        move = mover.choice(listed)
        if env.step(AssistantTurn(move, [], content=move)).done:
            break


def test_sampled_moves_are_uniform_draws_the_game_accepts():
    env = TextArenaEnv("ColonelBlotto-v0-extreme")
    env.reset(3)
    first = env.legal_moves()
    assert first == env.legal_moves()  # the same position, the same draw
    assert 0.9 * SAMPLED <= len(first) <= SAMPLED
    for move in first:  # seven fields, 75 units in all
        units = [int(u[1:]) for u in move[1:-1].split()]
        assert len(units) == 7 and sum(units) == 75, move
    env = TextArenaEnv("Mastermind-v0-extreme")
    env.reset(3)
    codes = [m[1:-1].split() for m in env.legal_moves()]
    assert len(codes) == SAMPLED and all(len(c) == 6 and all(1 <= int(d) <= 12 for d in c) for c in codes)


def test_the_named_games_play_by_their_state_and_a_game_without_moves_is_refused(monkeypatch):
    for game in ("Blackjack-v0", "TowerOfHanoi-v0", "Nim-v0", "IteratedRockPaperScissors-v0", "Chopsticks-v0",
                 "PigDice-v0", "Bandit-v0", "Battleship-v0", "Mastermind-v0", "Sudoku-v0", "Tak-v0"):
        (demo,) = TextArenaEnv(game, max_turns=3).demonstrations(1, seed=4)
        assert sum(m["role"] == "assistant" for m in demo) >= 1, game
    assert TextArenaEnv("TicTacToe-v0-train").raw_id == "TicTacToe-v0-raw"
    env = TextArenaEnv("Bandit-v0")
    env.reset(1)
    assert env.legal_moves() == ["[red]", "[blue]", "[green]", "[yellow]", "[purple]"]
    monkeypatch.setitem(MOVE_GENERATORS, "Bandit", lambda game, rng: ["[orange]"])
    with pytest.raises(ValueError, match=r"^textarena game Bandit-v0: no legal move found for player 0 \(its move "
                                         r"generator found none the game accepts\); pass opponent="):
        env.legal_moves()
    monkeypatch.delitem(MOVE_GENERATORS, "Bandit")  # its texts spell no move
    with pytest.raises(ValueError, match=r"^textarena game Bandit-v0: no legal move found for player 0 \(its texts "):
        env.legal_moves()
    assert candidate_moves("say '[0 3]' or [hit]") == ["[0 3]", "[hit]"] + [
        f"[{a} {b}]" for a in range(10) for b in range(10) if (a, b) != (0, 3)]
