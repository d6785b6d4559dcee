"""Several losses over one head pass: `CompositeLoss` sums weighted `LossTerm`s on the same lp and H."""

from __future__ import annotations

from dataclasses import dataclass, field

from ludic_fast.losses.base import HeadLoss, Stats


@dataclass
class LossTerm:
    """One named, weighted term of a CompositeLoss."""

    name: str
    loss: HeadLoss
    weight: float = 1.0


@dataclass
class CompositeLoss(HeadLoss):
    """total = sum_i weight_i loss_i over ONE head pass; stats '{name}/{k}', '{name}/weight', 'loss'."""

    terms: list[LossTerm] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("CompositeLoss needs at least one LossTerm")
        for term in self.terms:
            if not isinstance(term.loss, HeadLoss):
                raise TypeError(f"term {term.name!r}: loss must be a ludic_fast.losses loss, got {type(term.loss)}")

    @property
    def coupled(self) -> bool:  # type: ignore[override]
        return any(t.loss.coupled for t in self.terms)

    @property
    def needs_entropy(self) -> bool:  # type: ignore[override]
        return any(t.loss.needs_entropy for t in self.terms)

    def objective(self, lp, H, tb, with_stats):
        total = None
        stats: Stats = {}
        for term in self.terms:
            loss, child = term.loss.objective(lp, H, tb, with_stats)
            total = term.weight * loss if total is None else total + term.weight * loss
            if with_stats:
                stats[f"{term.name}/loss"] = loss
                stats[f"{term.name}/weight"] = float(term.weight)
                stats.update({f"{term.name}/{k}": v for k, v in child.items() if k != "loss"})
        if with_stats:
            stats["loss"] = total
        return total, stats
