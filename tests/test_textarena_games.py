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

from ludic_fast.agents.libraries.textarena import TextArenaEnv, candidate_moves  # noqa: E402
from ludic_fast.agents.protocol import AssistantTurn  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "environments.md"
#: "-train" ids play their game's "-raw" version; Sokoban-v0-medium's reset alone takes ~1 min (puzzle search)
SLOW = {"Sokoban-v0-medium"}
GAMES = sorted(g for g in ENV_REGISTRY if not g.endswith(("-raw", "-train")) and g not in SLOW)
MOVES = 2  # model moves per game: the sweep must stay fast
#: what a game that cannot be built here raises (missing package or data, an API key, a player count not 1 or 2)
NOT_BUILT = (ImportError, LookupError, SyntaxError, OSError, ValueError, AssertionError, KeyError, TypeError)


def play(game: str, seed: int = 1) -> tuple[str, str]:
    """(status, detail): "plays" (rewards equal textarena's replay), "refused" (no legal move) or "not built"."""
    try:
        env = TextArenaEnv(game, max_turns=MOVES)
        first = env.reset(seed)
    except NOT_BUILT as exc:
        return "not built", f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    mover, rewards, done = random.Random(seed), [], False
    try:
        for _ in range(MOVES):
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
    return "plays", f"{len(rewards)} moves, reward {rewards[-1]:g}"


def documented_not_playing() -> set[str]:
    """The games docs/environments.md lists as not playable (its table of games that do not play)."""
    text = DOCS.read_text()
    section = text.split("<!-- textarena-not-playing -->")[1]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def test_every_game_plays_or_is_refused_and_the_docs_list_the_ones_that_do_not():
    rows = {g: play(g) for g in GAMES}
    not_playing = {g for g, (status, _) in rows.items() if status != "plays"}
    assert sum(status == "plays" for status, _ in rows.values()) >= 100
    assert not_playing == documented_not_playing(), sorted(not_playing ^ documented_not_playing())


def test_the_named_games_play_by_their_state_and_a_game_without_moves_is_refused():
    for game in ("Blackjack-v0", "TowerOfHanoi-v0", "Nim-v0", "IteratedRockPaperScissors-v0", "Chopsticks-v0",
                 "PigDice-v0"):
        (demo,) = TextArenaEnv(game, max_turns=3).demonstrations(1, seed=4)
        assert sum(m["role"] == "assistant" for m in demo) >= 1, game
    assert TextArenaEnv("TicTacToe-v0-train").raw_id == "TicTacToe-v0-raw"
    env = TextArenaEnv("Bandit-v0")
    env.reset(1)
    with pytest.raises(ValueError, match=r"^textarena game Bandit-v0: no legal move found for player 0 \("):
        env.legal_moves()
    assert candidate_moves("say '[0 3]' or [hit]") == ["[0 3]", "[hit]"] + [
        f"[{a} {b}]" for a in range(10) for b in range(10) if (a, b) != (0, 3)]
