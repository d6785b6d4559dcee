"""Preference losses on the fused LM head: DPO with TRL 1.16's loss types (combined, f-DPO, LD-DPO, WPO), IPO,
CPO / AlphaPO, SimPO, ORPO and KTO; `make_preference_loss` builds one from a loss-type name.

Same calling conventions as every head loss (`ludic_fast.losses.base.HeadLoss`: `loss_fn(batch, hidden=,
weight=, bias=)`, `loss_fn(batch, logits=)`, `loss_fn.compute(logits, batch)`); position t scores token t+1, only action
tokens (the response) enter the head, no [N, V] tensor is formed.

Pair layout (`ludic_fast.data.pair_batching.collate_pairs`, padded or packed): sequence 2i is the chosen
response y_w of prompt i and sequence 2i+1 the rejected y_l, so a pair is contiguous in the token order and
chosen and rejected share one forward. KTO reads unpaired examples (`batch['kto_label']`).

Notation: L_b = Σ_t M_t lp_t of sequence b (÷ n_b = max(1, Σ_t M_t) when length-normalised); the reference
model's R_b from the batch, computed once by the same head under no_grad: `ref_logps` [B, T] per token (as
the RL losses read it) or `ref_seq_logps` [S] (Σ over the action tokens); R_b is normalised like L_b.
σ is the logistic function; every loss is a mean over pairs (KTO: over its labelled examples). The loss and
stats are float64 when the log-probs and reference values are (float64 head inputs), float32 otherwise.

A pair couples its tokens (the loss is a function of two sequence sums), not the batch: the fused mode
keeps each pair whole inside one row chunk and forms the gradient in the forward (6NDV); a pair longer than
a chunk falls back to the two-pass mode (8NDV). KTO with in-batch KL samples and the batch-sorted DPO types
(aot, aot_unpaired) couple the batch (8NDV).

Stats (detached): rewards_chosen / rewards_rejected (mean implicit reward), rewards_margin (mean of their
difference), rewards_accuracy (fraction of pairs with chosen reward > rejected), logps_chosen / _rejected;
the losses with a reference model add kl_chosen / kl_rejected (token mean of lp - ref_lp per side), and
`entropy_stats=True` adds entropy_chosen / entropy_rejected (token mean of the policy's entropy per side).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ludic_fast.losses.base import HeadLoss
from ludic_fast.losses.preference.common import log1mexp
from ludic_fast.losses.preference.dpo import DPOLoss, IPOLoss
from ludic_fast.losses.preference.dpo_terms import LOSS_TYPES as DPO_LOSS_TYPES
from ludic_fast.losses.preference.kto import KTOLoss
from ludic_fast.losses.preference.reference_free import CPO_LOSS_TYPES, CPOLoss, ORPOLoss, SimPOLoss

#: single-objective names of `make_preference_loss` besides the DPO loss types, with the class they build and
#: the fixed arguments they set
NAMED: dict[str, tuple[type[HeadLoss], dict[str, Any]]] = {
    "simpo": (SimPOLoss, {}),
    "orpo": (ORPOLoss, {}),
    "kto": (KTOLoss, {}),
    "cpo": (CPOLoss, {}),
    **{f"cpo_{t}": (CPOLoss, {"loss_type": t}) for t in CPO_LOSS_TYPES},
    "alphapo": (CPOLoss, {"loss_type": "simpo", "cpo_alpha": 0.0}),
}
PREFERENCE_LOSS_TYPES = (*DPO_LOSS_TYPES, *NAMED)


def make_preference_loss(
    loss_type: str | Sequence[str], *, weights: Sequence[float] | None = None, **options: Any
) -> HeadLoss:
    """The preference loss named by `loss_type`, with `options` passed to its class.

    - one or more of TRL 1.16's DPO loss types (`DPO_LOSS_TYPES`: sigmoid, hinge, ipo, exo_pair, nca_pair,
      robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sigmoid_norm, sft):
      `DPOLoss(loss_type=..., loss_weights=weights, **options)`, loss = Σ_k w_k mean_pairs ℓ_k
      (RPO: ["sigmoid", "sft"], weights [1, α]; MPO: ["sigmoid", "bco_pair", "sft"]);
    - "cpo" / "cpo_sigmoid", "cpo_hinge", "cpo_ipo", "cpo_simpo": `CPOLoss`; "alphapo": CPO's simpo type
      with cpo_alpha 0 and the AlphaPO `alpha` (required, ≠ 0) as TRL's CPOConfig;
    - "simpo", "orpo", "kto": `SimPOLoss`, `ORPOLoss`, `KTOLoss` (one objective, no weights).
    """
    names = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not names or any(not isinstance(n, str) for n in names):
        raise ValueError(f"loss_type must be a name or a non-empty list of names, got {loss_type!r}")
    unknown = [n for n in names if n not in PREFERENCE_LOSS_TYPES]
    if unknown:
        raise ValueError(f"loss_type: unknown {unknown}; known: {PREFERENCE_LOSS_TYPES}")
    if weights is not None and len(weights) != len(names):
        raise ValueError(f"weights needs one weight per loss type ({len(names)}), got {list(weights)}")
    if all(n in DPO_LOSS_TYPES for n in names):
        cls, fixed = DPOLoss, {"loss_type": names[0] if len(names) == 1 else list(names), "loss_weights": weights}
    elif len(names) == 1:
        if weights is not None:
            raise ValueError(f"weights applies to the DPO loss types only, not to {names[0]!r}")
        cls, fixed = NAMED[names[0]]
        if names[0] == "alphapo" and not options.get("alpha"):
            raise ValueError("loss_type 'alphapo' needs a nonzero alpha (AlphaPO's reward shape)")
    else:
        raise ValueError(f"loss_type: only DPO loss types combine ({DPO_LOSS_TYPES}), got {list(names)}")
    clash = sorted(set(fixed) & set(options))
    if clash:
        raise ValueError(f"loss_type {loss_type!r} sets {clash} itself; do not pass them as options")
    fields = {k for k, f in getattr(cls, "__dataclass_fields__", {}).items() if f.init}
    bad = sorted(set(options) - fields)
    if bad:
        raise TypeError(f"{cls.__name__} has no option {bad[0]!r} (its options: {sorted(fields)})")
    return cls(**fixed, **options)


__all__ = [
    "CPOLoss",
    "DPOLoss",
    "DPO_LOSS_TYPES",
    "CPO_LOSS_TYPES",
    "IPOLoss",
    "KTOLoss",
    "ORPOLoss",
    "PREFERENCE_LOSS_TYPES",
    "SimPOLoss",
    "log1mexp",
    "make_preference_loss",
]
