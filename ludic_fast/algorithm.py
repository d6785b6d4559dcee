"""RLAlgorithm = credit assigner + loss + batch preprocess, and the presets (Ludic master's names and defaults).

    algo = make_cispo(group_size=8)
    credit = algo.credit_assigner.compute(rollouts)            # rollout side
    saw_batch = algo.preprocess(saw_batch)                     # trainer, whole macro-batch, before micro-batching
    loss, stats = algo.compute_loss(batch, hidden=h, weight=lm_head.weight)   # per micro-batch, fused head

Presets (all arguments keyword-only; Ludic master's signatures where Ludic has the preset):

preset                  credit                          loss                                      preprocess
make_reinforce          MonteCarloReturn(γ)             ReinforceLoss()                           drop0
make_reinforce_baseline MonteCarloReturn(γ)             ReinforceBaselineLoss(normalize)          drop0
make_grpo               GroupNormalizedReturn           TokenClippedSurrogateLoss(0.2, 0.27) + KL drop0 V
make_dr_grpo            GroupNormalizedReturn(no std)   TokenClippedSurrogateLoss, Σ / const + KL drop0 V
make_dapo               GroupNormalized + soft overlong TokenClipped(0.2, 0.28), token mean       overlong zvp V
make_gspo               GroupNormalizedReturn           ClippedSurrogateLoss(3e-4, 4e-4, LN) + KL drop0 V
make_cispo              GroupNormalizedReturn           CISPOLoss(1e6, 0.2, LN) + KL              drop0 V
make_sft                ConstantCredit(1)               MaskedCausalLMCrossEntropyLoss(LN=False)  -
make_scalerl            BatchNormalizedReturn           ScaleRLLoss(eps_max=4) + TokenKLLoss      npr zvp drop0 V
make_rl_zvp             ZVPGroupNormalizedReturn        ZVPCISPOLoss(alpha_zvp=0.1)               V
drop0 = drop_zero_weight_samples, zvp = filter_zero_variance_groups, npr = NoPositiveResampling,
V = validate_actor_logps, overlong = drop truncated items, KL = TokenKLLoss(kl_coeff); each except V is
optional (a flag), as are the soft overlong punishment, Dr. GRPO's constant and the KL terms. make_scalerl
also sets fp32_head. make_grpo, make_gspo and make_cispo are one builder (`_group_clipped_preset`) at three
rows of defaults; make_dr_grpo is make_grpo without the std division.

Difference from Ludic master: its `make_scalerl` uses CISPOLoss(0.20, 0.28) with a per-sequence mean; ours
follows the ScaleRL paper (Khatri et al. 2025, arXiv:2510.13786): ScaleRLLoss (absolute cap min(r, eps_max),
prompt-level aggregation), No-Positive-Resampling and an fp32 head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ludic_fast import losses as L  # the loss classes of every preset come from this one import
from ludic_fast._common import to_fp32
from ludic_fast.data.credit import (
    BatchNormalizedReturn,
    ConstantCredit,
    GroupNormalizedReturn,
    MonteCarloReturn,
    ShapedCredit,
    SoftOverlongPunishment,
    ZVPGroupNormalizedReturn,
)
from ludic_fast.data.curriculum import NoPositiveResampling
from ludic_fast.data.filters import (
    combine,
    compose_preprocess,
    drop_incomplete_completions,
    drop_items,
    drop_truncated,
    drop_zero_weight_samples,
    filter_zero_variance_groups,
    validate_actor_logps,
)
from ludic_fast.data.types import CreditAssigner, Preprocess

Stats = dict[str, Any]


@dataclass
class RLAlgorithm:
    """A named credit assigner + loss + optional batch preprocess.

    `fp32_head`: run the LM head in float32 (hidden, weight, bias or logits are upcast before the loss;
    ScaleRL's "FP32 logits"). `curriculum`: the NoPositiveResampling history the preprocess feeds, for the
    rollout side (`active()`) and for checkpoints (`state_dict()`).
    """

    name: str
    credit_assigner: CreditAssigner
    loss: L.HeadLoss
    preprocess: Preprocess | None = None
    fp32_head: bool = False
    curriculum: NoPositiveResampling | None = None

    def compute_loss(
        self,
        batch: Mapping[str, Tensor],
        *,
        hidden: Tensor | None = None,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        logits: Tensor | None = None,
        **head_kwargs: Any,
    ) -> tuple[Tensor, Stats]:
        """(loss, stats) of one micro-batch: `self.loss(batch, hidden=, weight=, bias=)` or `(batch, logits=)`."""
        if self.fp32_head:
            hidden, weight, bias, logits = to_fp32(hidden, weight, bias, logits)
        if logits is not None:
            if hidden is not None or weight is not None:
                raise ValueError("pass either logits= or hidden= with weight=, not both")
            return self.loss(batch, logits=logits)
        return self.loss(batch, hidden=hidden, weight=weight, bias=bias, **head_kwargs)


# ---------------------------------------------------------------------------------------- helpers
def _compose(steps: list[Preprocess]) -> Preprocess | None:
    return compose_preprocess(*steps) if steps else None


def _zero_weight(drop_zero_weight: bool, eps: float) -> list[Preprocess]:
    if eps < 0:
        raise ValueError("drop_zero_weight_eps must be >= 0.")
    return [lambda b: drop_zero_weight_samples(b, eps=eps)] if drop_zero_weight else []


def _zvp_filter(filter_zvp: bool, eps: float) -> list[Preprocess]:
    if eps < 0:
        raise ValueError("zvp_filter_eps must be >= 0.")
    return [lambda b: filter_zero_variance_groups(b, eps=eps)] if filter_zvp else []


def _with_kl(loss: L.HeadLoss, name: str, kl_coeff: float, length_normalize: bool) -> L.HeadLoss:
    if kl_coeff < 0:
        raise ValueError(f"kl_coeff must be >= 0, got {kl_coeff}")
    if kl_coeff == 0:
        return loss
    kl = L.TokenKLLoss(coeff=kl_coeff, length_normalize=length_normalize)
    return L.CompositeLoss([L.LossTerm(name, loss, 1.0), L.LossTerm("kl", kl, 1.0)])


# ----------------------------------------------------------------------------------------- presets
def make_reinforce(
    *, gamma: float = 1.0, drop_zero_weight: bool = False, drop_zero_weight_eps: float = 1e-4, name: str = "reinforce"
) -> RLAlgorithm:
    """REINFORCE with the sequence IS weight on Monte-Carlo returns (needs old_logp_action at loss time)."""
    steps = _zero_weight(drop_zero_weight, drop_zero_weight_eps)
    return RLAlgorithm(name, MonteCarloReturn(gamma=gamma), L.ReinforceLoss(), _compose(steps))


def make_reinforce_baseline(
    *,
    gamma: float = 1.0,
    name: str = "reinforce_baseline",
    normalize_adv: bool = False,
    drop_zero_weight: bool = False,
    drop_zero_weight_eps: float = 1e-4,
) -> RLAlgorithm:
    """REINFORCE with the micro-batch mean return as baseline (std-normalised when normalize_adv)."""
    steps = _zero_weight(drop_zero_weight, drop_zero_weight_eps)
    loss = L.ReinforceBaselineLoss(normalize=normalize_adv)
    return RLAlgorithm(name, MonteCarloReturn(gamma=gamma), loss, _compose(steps))


def _group_clipped_preset(preset: str, loss_cls: type[L.HeadLoss], *, clip: tuple[float, float],
                          length_normalize: bool, doc: str) -> Callable[..., RLAlgorithm]:
    """A preset of group-normalised credit (GroupNormalizedReturn) and the clipped objective `loss_cls` at its
    defaults `clip` = (clip_eps_low, clip_eps_high) and `length_normalize`, plus TokenKLLoss(kl_coeff) when
    kl_coeff > 0, zero-weight dropping when asked and the actor-logprob check. `loss_options` are further
    keyword arguments of `loss_cls` (ratio_clip; aggregation, norm_length)."""

    def make(
        *,
        group_size: int,
        group_normalize_adv: bool = True,
        positive_only: bool = False,
        clip_eps_low: float = clip[0],
        clip_eps_high: float = clip[1],
        length_normalize: bool = length_normalize,
        kl_coeff: float = 0.0,
        drop_zero_weight: bool = False,
        drop_zero_weight_eps: float = 1e-4,
        name: str = preset,
        **loss_options: Any,
    ) -> RLAlgorithm:
        credit = GroupNormalizedReturn(group_size, normalize_adv=group_normalize_adv, positive_only=positive_only)
        loss = loss_cls(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, length_normalize=length_normalize,
                        **loss_options)
        steps = [*_zero_weight(drop_zero_weight, drop_zero_weight_eps), validate_actor_logps]
        return RLAlgorithm(name, credit, _with_kl(loss, preset, kl_coeff, length_normalize), _compose(steps))

    make.__name__ = make.__qualname__ = f"make_{preset}"
    make.__doc__ = doc
    return make


make_grpo = _group_clipped_preset(
    "grpo", L.TokenClippedSurrogateLoss, clip=(0.2, 0.27), length_normalize=False,
    doc="GRPO: group-normalised advantages, token-clipped PPO surrogate (TokenClippedSurrogateLoss).")
make_gspo = _group_clipped_preset(
    "gspo", L.ClippedSurrogateLoss, clip=(3e-4, 4e-4), length_normalize=True,
    doc="GSPO: sequence-level (geometric-mean) ratio, clipped surrogate (ClippedSurrogateLoss).")
make_cispo = _group_clipped_preset(
    "cispo", L.CISPOLoss, clip=(1e6, 0.2), length_normalize=True,
    doc="CISPO: clipped, detached IS weight on REINFORCE (CISPOLoss); with kl_coeff > 0 plus TokenKLLoss(kl_coeff).")


def make_dr_grpo(*, norm_length: float | None = None, name: str = "dr_grpo", **options: Any) -> RLAlgorithm:
    """Dr. GRPO: `make_grpo` (its other options) with mean-centred advantages without std division; with
    `norm_length` (the maximum completion length) each sequence's token sum is divided by that constant
    (aggregation seq_mean_token_sum_norm)."""
    if "group_normalize_adv" in options:
        raise TypeError("make_dr_grpo() takes no group_normalize_adv: Dr. GRPO never divides by the group's std")
    if norm_length is not None:
        if norm_length <= 0:
            raise ValueError(f"norm_length must be > 0, got {norm_length}")
        options.update(aggregation="seq_mean_token_sum_norm", norm_length=float(norm_length))
    return make_grpo(group_normalize_adv=False, name=name, **options)


def make_dapo(
    *,
    group_size: int,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    max_completion_length: int | None = None,
    overlong_cache_length: int | None = None,
    mask_truncated: bool = True,
    filter_zvp: bool = True,
    zvp_filter_eps: float = 1e-6,
    name: str = "dapo",
) -> RLAlgorithm:
    """DAPO (arXiv 2503.14476): clip-higher (0.2, 0.28), token-mean loss, group-normalised advantages;
    overlong filtering (drop items truncated or stopped on the length limit); soft overlong punishment
    when `max_completion_length` and `overlong_cache_length` are given; zero-variance groups dropped (the
    batch-side half of dynamic sampling; resampling belongs to the rollout side)."""
    credit: CreditAssigner = GroupNormalizedReturn(group_size, normalize_adv=True)
    if (max_completion_length is None) != (overlong_cache_length is None):
        raise ValueError("pass both max_completion_length and overlong_cache_length for soft overlong punishment")
    if max_completion_length is not None:
        punish = SoftOverlongPunishment(max_length=max_completion_length, cache_length=overlong_cache_length)
        credit = ShapedCredit(credit, [punish])
    loss = L.TokenClippedSurrogateLoss(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, aggregation="token_mean")
    steps = [drop_items(combine(drop_truncated, drop_incomplete_completions))] if mask_truncated else []
    steps += [*_zvp_filter(filter_zvp, zvp_filter_eps), validate_actor_logps]
    return RLAlgorithm(name, credit, loss, _compose(steps))


def make_sft(*, length_normalize: bool = False, name: str = "sft") -> RLAlgorithm:
    """SFT: weight 1 for every step, masked causal-LM cross-entropy (sum over tokens unless length_normalize)."""
    return RLAlgorithm(name, ConstantCredit(1.0), L.MaskedCausalLMCrossEntropyLoss(length_normalize=length_normalize))


def make_scalerl(
    *,
    group_size: int,
    positive_only: bool = False,
    eps_max: float = 4.0,
    kl_coeff: float = 0.0,
    filter_zvp: bool = True,
    zvp_filter_eps: float = 1e-6,
    no_positive_resampling: bool | NoPositiveResampling = True,
    drop_zero_weight: bool = False,
    drop_zero_weight_eps: float = 1e-4,
    fp32_head: bool = True,
    name: str = "scalerl",
) -> RLAlgorithm:
    """ScaleRL (arXiv 2510.13786): batch-normalised advantages (group-mean centring, batch std), ScaleRLLoss
    (sg(min(r, eps_max)) A lp, prompt-level aggregation by batch['group_id']), zero-variance filtering,
    No-Positive-Resampling (True: an in-memory history; pass a NoPositiveResampling with a path to persist
    it) and an fp32 head. The history is fed before the zero-variance filter, so all-correct groups count;
    items need meta['prompt_id'] (or request_meta.prompt_id)."""
    curriculum = None
    if isinstance(no_positive_resampling, NoPositiveResampling):
        curriculum = no_positive_resampling
    elif no_positive_resampling:
        curriculum = NoPositiveResampling()
    steps: list[Preprocess] = [] if curriculum is None else [curriculum.preprocess]
    steps += [
        *_zvp_filter(filter_zvp, zvp_filter_eps),
        *_zero_weight(drop_zero_weight, drop_zero_weight_eps),
        validate_actor_logps,
    ]
    credit = BatchNormalizedReturn(group_size, positive_only=positive_only)
    loss = _with_kl(L.ScaleRLLoss(eps_max=eps_max), "scalerl", kl_coeff, True)
    return RLAlgorithm(name, credit, loss, _compose(steps), fp32_head=fp32_head, curriculum=curriculum)


def make_rl_zvp(
    *,
    group_size: int,
    alpha_zvp: float = 0.1,
    group_normalize_adv: bool = True,
    clip_eps_low: float = 1e6,
    clip_eps_high: float = 0.2,
    length_normalize: bool = True,
    zvp_eps: float = 1e-6,
    name: str = "rl_zvp",
) -> RLAlgorithm:
    """RL-ZVP (arXiv 2509.21880) on CISPO: zero-variance groups get weight 0 and zvp_direction ±1 from the
    credit assigner, and ZVPCISPOLoss turns them into entropy-guided advantages. No zero-weight dropping
    and no zero-variance filter: those would remove exactly the samples RL-ZVP learns from."""
    credit = ZVPGroupNormalizedReturn(group_size, normalize_adv=group_normalize_adv, eps=zvp_eps)
    loss = L.ZVPCISPOLoss(
        clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, length_normalize=length_normalize, alpha_zvp=alpha_zvp
    )
    return RLAlgorithm(name, credit, loss, validate_actor_logps)


__all__ = [
    "RLAlgorithm",
    "make_reinforce",
    "make_reinforce_baseline",
    "make_grpo",
    "make_dr_grpo",
    "make_dapo",
    "make_gspo",
    "make_cispo",
    "make_sft",
    "make_scalerl",
    "make_rl_zvp",
]
