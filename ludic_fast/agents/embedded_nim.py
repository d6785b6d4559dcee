"""An embedded two-player game the tiny embedded model can learn: Nim with one pile (no download, CPU).

A pile of n stones, n drawn from the seed in [min_stones, max_stones]; the players take 1 or 2 stones in turn
(seat 0 first); whoever takes the last stone wins: reward +1, the other -1. A move that is not "1" or "2", or
takes more stones than are left, loses at once (the mover -1, the other +1). After `max_moves` moves in all
the game is a draw (0, 0). Optimal play: take n mod 3 when it is not 0 (it leaves a multiple of 3); a player
who does so from a pile that is not a multiple of 3 always wins, and wins most games against random moves.

Each seat is sent one text per turn: the pile at its first turn ("nim, take 1 or 2, pile 7:"), then the
other player's move and the pile ("they took 2, pile 5:"); the pile comes last, next to the move it decides.
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
        if self.last is None:
            return f"nim, take 1 or 2, pile {self.stones}:"
        return f"they took {self.last}, pile {self.stones}:"

    def legal_moves(self) -> list[str]:
        return [str(k) for k in (1, 2) if k <= self.stones]

    def play(self, seat: int, move: str) -> None:
        """`seat` moves `move` (the turn's text, stripped); the game may end."""
        if seat != self.to_move() or self.done():
            raise ValueError(f"seat {seat} cannot move now")
        move = move.strip()
        self.moves += 1
        if move not in self.legal_moves():
            self.winner = 1 - seat
            return
        self.stones -= int(move)
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
