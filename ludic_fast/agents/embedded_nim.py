"""An embedded two-player game the tiny embedded model can learn: Nim with one pile (no download, CPU).

A pile of n stones, n drawn from the seed in [min_stones, max_stones]; the players take 1 or 2 stones in turn
(seat 0 first), and a move is written as the pile it leaves: from 7 the legal moves are "6" and "5". Whoever
takes the last stone (leaves "0") wins: reward +1, the other -1. A move that is not one of the legal piles loses
at once (the mover -1, the other +1). After `max_moves` moves in all the game is a draw (0, 0). Optimal play
leaves a multiple of 3; a player who can (the pile is not a multiple of 3) and always does wins, and wins most
games against random moves.

Each seat is sent one text per turn: the pile at its first turn ("nim pile 7"), then the pile the other player
left ("they left 5"); the pile's last digit is the token right before the answer. Why the move names the pile
left rather than the stones taken: the legal answers then depend on the pile, so the warm-up on random moves
already teaches the model to read it. With "take 1 or 2" the warm-up's targets do not depend on the pile, and the
tiny model came out of it with the pile drowned in its last hidden state (cosine 0.99 between piles 2-9) and
learned no pile-dependent move by self-play (docs/agents.md).
"""

from __future__ import annotations

import random

from ludic_fast.agents.protocol import Message


class NimGame:
    """One-pile Nim for two seats (module docstring); implements `ludic_fast.agents.selfplay.TwoPlayerGame`."""

    def __init__(self, min_stones: int = 4, max_stones: int = 9, max_moves: int = 12):
        if not 1 <= min_stones <= max_stones:
            raise ValueError(f"need 1 <= min_stones <= max_stones, got {min_stones}, {max_stones}")
        if max_moves < 1:
            raise ValueError(f"max_moves must be >= 1, got {max_moves}")
        self.min_stones, self.max_stones, self.max_moves = min_stones, max_stones, max_moves
        self.stones, self.moves, self.winner = 0, 0, None
        self.last: str | None = None

    def reset(self, seed: int) -> None:
        self.stones = random.Random(seed).randint(self.min_stones, self.max_stones)
        self.moves, self.winner, self.last = 0, None, None

    def to_move(self) -> int:
        return self.moves % 2

    def observation(self, seat: int) -> str:
        return f"nim pile {self.stones}" if self.last is None else f"they left {self.stones}"

    def legal_moves(self) -> list[str]:
        return [str(self.stones - k) for k in (1, 2) if k <= self.stones]

    def play(self, seat: int, move: str) -> None:
        """`seat` moves `move` (the turn's text, stripped: the pile it leaves); the game may end."""
        if seat != self.to_move() or self.done():
            raise ValueError(f"seat {seat} cannot move now")
        move = move.strip()
        self.moves += 1
        if move not in self.legal_moves():
            self.winner = 1 - seat
            return
        self.stones = int(move)
        self.last = move
        if self.stones == 0:
            self.winner = seat

    def resign(self, seat: int) -> None:
        self.winner = 1 - seat

    def done(self) -> bool:
        return self.winner is not None or self.moves >= self.max_moves

    def rewards(self) -> tuple[float, float]:
        if self.winner is None:
            return 0.0, 0.0
        return (1.0, -1.0) if self.winner == 0 else (-1.0, 1.0)

    def demonstration(self, seed: int) -> list[list[Message]]:
        """Both seats' conversations of one game of uniformly random legal moves (drawn from `seed`)."""
        self.reset(seed)
        rng = random.Random(f"nim-demo:{seed}")
        chats: list[list[Message]] = [[], []]
        while not self.done():
            seat = self.to_move()
            chats[seat].append({"role": "user", "content": self.observation(seat)})
            move = rng.choice(self.legal_moves())
            chats[seat].append({"role": "assistant", "content": move})
            self.play(seat, move)
        return [c for c in chats if c]

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """The seats' conversations of n random-move games on seeds drawn from `seed` (SFT warm-up: the format)."""
        rng = random.Random(seed)
        return [chat for _ in range(n) for chat in self.demonstration(rng.randrange(2**31))]


__all__ = ["NimGame"]
