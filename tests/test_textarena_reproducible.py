"""A seed gives the same textarena game whatever else runs: concurrent Blackjack episodes (cards drawn from Python's
global `random` inside `step`) equal textarena run alone with the same seed and moves; OwnRandomState keeps
the global generators' states apart and gives code outside its blocks its own sequence back."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

ta = pytest.importorskip("textarena", reason="textarena is not installed (pip install 'ludic-fast[textarena]')")

from ludic_fast.agents.libraries.textarena import TextArenaEnv, render  # noqa: E402
from ludic_fast.agents.own_random import OwnRandomState  # noqa: E402
from ludic_fast.agents.protocol import AssistantTurn  # noqa: E402

SEEDS = [11, 12, 13, 14, 15, 16]
MOVES = ["[Hit]", "[Stand]", "[Hit]", "[Hit]", "[Stand]", "[Stand]", "[Hit]", "[Stand]"]


def alone(seed: int) -> list[tuple[str | None, float]]:
    """textarena's own Blackjack, one game at a time: (observation or None at the end, reward) per move."""
    game = ta.make("Blackjack-v0-raw")
    game.reset(num_players=1, seed=seed)
    out: list[tuple[str | None, float]] = [(render(game.get_observation()[1], 0), 0.0)]
    for m in MOVES:
        done, _ = game.step(m)
        if done:
            out.append((None, float(game.close()[0][0])))
            break
        out.append((render(game.get_observation()[1], 0), 0.0))
    return out


def test_concurrent_blackjack_episodes_equal_the_library_alone():
    expected = {s: alone(s) for s in SEEDS}
    got: dict[int, list] = {}
    barrier = threading.Barrier(len(SEEDS))

    def play(seed: int) -> None:
        env = TextArenaEnv("Blackjack-v0")
        trace = [(env.reset(seed)[0]["content"], 0.0)]
        done = False
        for m in MOVES:
            barrier.wait()  # every episode has reset (and reseeded the global generator) before any steps
            if not done:
                r = env.step(AssistantTurn(m, [], content=m))
                done = r.done
                trace.append((None if done else r.observations[0]["content"], r.reward))
        got[seed] = trace

    threads = [threading.Thread(target=play, args=(s,)) for s in SEEDS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected
    assert len({str(v) for v in expected.values()}) == len(SEEDS)  # different seeds, different games


def test_own_random_state_interleaved_equals_alone_and_leaves_the_outer_sequence():
    def draws(state: OwnRandomState) -> list[tuple[float, float]]:
        with state:
            return [(random.random(), float(np.random.random())) for _ in range(2)]

    ref_a, ref_b = OwnRandomState(1), OwnRandomState(2)
    expected_a, expected_b = draws(ref_a) + draws(ref_a), draws(ref_b) + draws(ref_b)
    random.seed(99)
    np.random.seed(99)
    outer = [(random.random(), float(np.random.random())) for _ in range(2)]
    random.seed(99)
    np.random.seed(99)
    first = (random.random(), float(np.random.random()))
    sa, sb = OwnRandomState(1), OwnRandomState(2)
    got_a, got_b = draws(sa), draws(sb)
    got_a, got_b = got_a + draws(sa), got_b + draws(sb)
    assert (got_a, got_b) == (expected_a, expected_b) and got_a != got_b
    assert [first, (random.random(), float(np.random.random()))] == outer
