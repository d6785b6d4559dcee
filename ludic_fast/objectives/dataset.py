"""The part the offline objectives (preference, KTO, reward, distillation) share: a step takes the next
`batch_size` examples of an `ExampleStream`, splits them in order into micro-batches of at most
`micro_token_budget` tokens (padded: sequences x the longest; packed: the sum of lengths, each sequence cut
to `max_seq_len`), collates each in the engine's layout, and records the n_k-weighted mean of each
micro-batch statistic, so the step's loss and record are those of the mean over its examples (n_k: a
micro-batch's examples, or its tokens for a token-mean loss, `size`).

Data-parallel ranks (`shard(rank, world_size)`): every rank draws the same global batch and keeps examples
rank, rank + W, ...; the engine divides by the sizes summed over the ranks (`global_mean`), so the step is
the mean over the union of the ranks' examples, and the stream's position (a checkpoint's) is the same on
every rank, whatever W.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast._deprecation import renamed_attributes
from ludic_fast.engine.objective import EngineView, MicroBatch
from ludic_fast.objectives.examples import ExampleStream


class DatasetObjective:
    """Base of the offline objectives: subclasses give `name`, `lengths(example)` (the token counts of its
    sequences), `collate(examples, engine)` and `loss(engine, batch)`; `frozen_models()` and
    `parameters()` default to none. `stream` is set by `use_examples` before training."""

    name = "offline"
    stream: ExampleStream | None = None
    #: the engine divides a step's loss by its sizes summed over the data-parallel ranks
    global_mean = True
    #: (rank, world size) of the examples this process trains on
    share: tuple[int, int] = (0, 1)

    def use_examples(self, examples: Sequence[Any], *, batch_size: int, seed: int = 0) -> DatasetObjective:
        """Draw each step's `batch_size` examples from `examples` (reshuffled by `seed` when exhausted)."""
        self.stream = ExampleStream(examples, batch_size=batch_size, seed=seed)
        return self

    def shard(self, rank: int, world_size: int) -> DatasetObjective:
        """Train on examples rank, rank + world_size, ... of each global batch of `batch_size`."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
        self.share = (rank, world_size)
        return self

    def frozen_models(self) -> list[nn.Module]:
        return []

    def parameters(self) -> list[nn.Parameter]:
        return []

    def prepare(self, engine: EngineView, examples: list[Any], places: list[int]) -> list[Any]:
        """This rank's examples as trained on (on-policy distillation replaces completions); `places`: their
        positions in the step's global batch."""
        del engine, places
        return examples

    def lengths(self, example: Any) -> list[int]:
        raise NotImplementedError

    def collate(self, examples: list[Any], engine: EngineView) -> dict[str, Tensor]:
        raise NotImplementedError

    async def next_batch(self, engine: EngineView) -> list[Any]:
        if self.stream is None:
            raise ValueError(f"{type(self).__name__}: call use_examples(examples, batch_size=...) first")
        batch = self.stream.next()
        rank, world = self.share
        places = list(range(rank, len(batch), world))
        return self.prepare(engine, [batch[i] for i in places], places)

    def micro_batches(self, engine: EngineView, examples: list[Any]) -> list[MicroBatch]:
        chunks = split_by_tokens(examples, [self.lengths(e) for e in examples], engine.cfg.micro_token_budget,
                                 max_seq_len=engine.cfg.max_seq_len, packed=engine.cfg.layout == "packed")
        return [MicroBatch(batch, self.size(batch, len(chunk)), examples=len(chunk)) for chunk in chunks
                for batch in (self.collate(chunk, engine),)]

    def size(self, batch: dict[str, Tensor], n_examples: int) -> int:
        """A micro-batch's weight in the step's mean: its examples (a token-mean loss: its tokens)."""
        del batch
        return n_examples

    def step_stats(self, engine: EngineView, examples: list[Any], micro_stats: Sequence[dict[str, Any]],
                   sizes: Sequence[int]) -> dict[str, Any]:
        n = sum(sizes)
        out: dict[str, float] = {}
        for stats, size in zip(micro_stats, sizes):
            for key, value in stats.items():
                out[key] = out.get(key, 0.0) + float(value) * size / n
        out["num_examples"] = float(len(examples))
        return out

    def after_step(self, engine: EngineView, stats: dict[str, Any], aux: Sequence[Any], finite: bool) -> None:
        return None

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        meta = {"examples": None if self.stream is None else self.stream.state_dict()}
        return meta, {f"objective.{i}": p.detach() for i, p in enumerate(self.parameters())}

    def load_state(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        if self.stream is not None and meta.get("examples"):
            self.stream.load_state_dict(meta["examples"])
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                if f"objective.{i}" in tensors:
                    p.copy_(tensors[f"objective.{i}"])


def split_by_tokens(examples: list[Any], lengths: list[list[int]], budget: int, *, max_seq_len: int,
                    packed: bool) -> list[list[Any]]:
    """`examples` in order, cut into chunks whose token cost stays within `budget` (module docstring); an
    example that alone exceeds it is a ValueError naming the budget."""
    chunks: list[list[Any]] = []
    chunk: list[Any] = []
    seqs: list[int] = []
    for example, lens in zip(examples, lengths):
        lens = [min(n, max_seq_len) for n in lens]
        if _cost(lens, packed) > budget:
            raise ValueError(f"micro_token_budget ({budget}) is below one example's {_cost(lens, packed)} tokens")
        if chunk and _cost(seqs + lens, packed) > budget:
            chunks.append(chunk)
            chunk, seqs = [], []
        chunk.append(example)
        seqs += lens
    chunks.append(chunk)
    return chunks


def _cost(lengths: list[int], packed: bool) -> int:
    return sum(lengths) if packed else len(lengths) * max(lengths)


__getattr__ = renamed_attributes(__name__, globals(), {"OfflineObjective": "DatasetObjective"})

__all__ = ["DatasetObjective", "split_by_tokens"]
