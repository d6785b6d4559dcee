"""verl drop-in: a fused forward returning log_probs and entropy from hidden states, and policy losses for
verl's registry.

Fused forward. verl's actor with `use_fused_kernels=True` calls `model(input_ids, attention_mask,
position_ids, temperature=T, ...)` and reads `.log_probs` and `.entropy` ([B, T], position t scoring the
rolled label `input_ids[t+1]`; the last position wraps around and is discarded by verl).
`patch_fused_forward(model)` gives any transformers causal LM that forward, computed by
`ludic_fast.linear_logprobs` from the base model's final hidden states and the model's head (scale,
softcap, bias, tied, PEFT; `ludic_fast.integrations.transformers`), never holding `[B, T, V]` logits.

Policy losses. `register_verl_policy_losses()` (run on import when verl is importable, e.g. through verl's
`external_lib`) registers, under `ludic_fast_<name>`, functions with verl's `PolicyLossFn` signature

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})

with r = exp(clamp(lp - old, -20, 20)) (token) and, per token, times the rollout IS weights when given:

    vanilla: dual-clip PPO   max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), and for A < 0 min(that, -A c)
    gspo:    the same clip on s = exp(min(sg(mean_seq(lp - old)) + lp - sg(lp), 10))
    cispo:   -sg(clip(r, 1-eps_low, 1+eps_high)) A lp
    sapo:    -sigmoid(tau (r - 1)) 4/tau A, tau = tau_pos if A > 0 else tau_neg, always seq-mean-token-mean

aggregated as verl does (`token-mean`, `token-sum`, `seq-mean-token-sum`, `seq-mean-token-sum-norm`,
`seq-mean-token-mean`, with `config.global_batch_info`'s dp_size / batch_num_tokens / global_batch_size /
loss_scale_factor). verl's actor then backpropagates through `log_prob`, i.e. through the fused head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.integrations.transformers import call_head, final_hidden_states, unwrap_model
from ludic_fast.losses.policy_terms import cispo_weight, ppo_clip_loss, sapo_gate

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


@dataclass
class FusedPPOOutput:
    """What verl's fused-kernel actor reads from the model: per-token log_probs and entropy, float32 [B, T]."""

    log_probs: Tensor
    entropy: Tensor | None
    past_key_values: Any = None
    hidden_states: Any = None
    attentions: Any = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


_IGNORED_FORWARD_KWARGS = ("return_dict", "use_cache", "output_attentions", "output_hidden_states", "logits_to_keep")


def fused_ppo_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    *,
    temperature: float | Tensor = 1.0,
    labels: Tensor | None = None,
    shift_labels: Tensor | None = None,
    calculate_entropy: bool = True,
    fp32_head: bool = False,
    **forward_kwargs: Any,
) -> FusedPPOOutput:
    """log p(y_t) and H_t of `softcap(scale (h W^T + b)) / T` at every position, from the final hidden states.

    Targets: `shift_labels` as given, else `roll(labels or input_ids, -1)` (verl's convention; the last
    position scores the wrapped-around first token). Targets equal to -100 get 0.
    """
    for key in _IGNORED_FORWARD_KWARGS:
        forward_kwargs.pop(key, None)
    hidden = final_hidden_states(model, input_ids, attention_mask, position_ids=position_ids, **forward_kwargs)
    if shift_labels is not None:
        targets = shift_labels
    else:
        targets = torch.roll(input_ids if labels is None else labels, shifts=-1, dims=-1)
    out = call_head(
        model,
        lambda head, h: head.logprobs(h, targets, temperature=temperature, entropy=calculate_entropy),
        hidden,
        fp32_head=fp32_head,
    )
    return FusedPPOOutput(log_probs=out.logprobs, entropy=out.entropy)


def patch_fused_forward(model: nn.Module, *, fp32_head: bool = False) -> nn.Module:
    """Make `model(...)` (the causal LM inside any wrapper) return `FusedPPOOutput`, as verl's fused kernels do.

    Call before wrapping the model with FSDP; returns `model`. `unpatch_fused_forward` restores it.
    """
    lm = unwrap_model(model)

    def forward(*args: Any, **kwargs: Any) -> FusedPPOOutput:
        return fused_ppo_forward(lm, *args, fp32_head=fp32_head, **kwargs)

    lm.forward = functools.wraps(type(lm).forward)(forward)
    return model


def unpatch_fused_forward(model: nn.Module) -> nn.Module:
    """Undo `patch_fused_forward`."""
    unwrap_model(model).__dict__.pop("forward", None)
    return model


# --- policy losses -----------------------------------------------------------------------------------------


def _masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x m) with x zeroed (NaN-safe) where m == 0."""
    terms = torch.where(mask.bool(), x, 0.0) * mask
    return terms.sum() if dim is None else terms.sum(dim)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _masked_sum(x, mask) / (mask.sum() + 1e-8)


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """verl's loss aggregation of a [B, T] per-token loss (scaled by dp_size so DP gradient averaging sums).

    token-mean: sum(l m) / batch_num_tokens; token-sum: sum(l m); seq-mean-token-sum: sum_b(sum_t l m) /
    global_batch_size (sequences with any token); -norm: that / loss_scale_factor (default T);
    seq-mean-token-mean: sum_b(sum_t l m / |m_b|) / global_batch_size. All times dp_size.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = mask.sum()
        return _masked_sum(loss_mat, mask) / batch_num_tokens * dp_size
    if mode == "token-sum":
        return _masked_sum(loss_mat, mask) * dp_size
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    tokens = mask.sum(-1)
    seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / (tokens + 1e-8)
    has_tokens = (tokens > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = has_tokens.sum()
    loss = _masked_sum(seq, has_tokens) / global_batch_size * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if hasattr(config, "get"):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _clip_range(config: Any) -> tuple[float, float]:
    eps = _cfg(config, "clip_ratio", 0.2)
    return float(_cfg(config, "clip_ratio_low", eps)), float(_cfg(config, "clip_ratio_high", eps))


def _batch_info(config: Any) -> dict[str, Any]:
    info = _cfg(config, "global_batch_info", {})
    return dict(info) if info else {}


def _finish(pg_losses, mask, mode, config, rollout_is_weights, clipfrac, ppo_kl, clipfrac_lower):
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = aggregate(pg_losses, mask, mode, **_batch_info(config))
    metrics = {
        "actor/pg_clipfrac": float(clipfrac),
        "actor/ppo_kl": float(ppo_kl),
        "actor/pg_clipfrac_lower": float(clipfrac_lower),
    }
    return loss, metrics


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def _clip_frac(clipped: Tensor, adv: Tensor, ratio: Tensor, mask: Tensor) -> Tensor:
    """verl's pg_clipfrac: the share of tokens where the clipped term is the larger loss, -A clip(r) > -A r."""
    return _masked_mean((clipped > -adv * ratio).float(), mask)


def policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                        config=None, rollout_is_weights=None):
    """Dual-clip PPO (verl "vanilla"): for A < 0 the clipped loss is further capped at -A * clip_ratio_c."""
    low, high = _clip_range(config)
    clip_c = float(_cfg(config, "clip_ratio_c", 3.0))
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_c}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    pg_losses = ppo_clip_loss(ratio, advantages, 1 - low, 1 + high, dual_clip=clip_c)
    with torch.no_grad():
        clipped = ppo_clip_loss(ratio, advantages, 1 - low, 1 + high)  # before the dual clip
        clipfrac = _clip_frac(clipped, advantages, ratio, response_mask)
        clipfrac_lower = _masked_mean(((clipped > -advantages * clip_c) & (advantages < 0)).float(), response_mask)
        ppo_kl = _masked_mean(-log_ratio, response_mask)
    return _finish(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, clipfrac, ppo_kl,
                   clipfrac_lower)


def policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                     config=None, rollout_is_weights=None):
    """GSPO: the PPO clip on s_t = sg(seq ratio) * pi / sg(pi), seq ratio = exp(mean_seq(lp - old))."""
    low, high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(-1).clamp(min=1)
    seq = ((log_ratio * response_mask).sum(-1) / lengths).detach()
    ratio = torch.exp(torch.clamp(log_prob - log_prob.detach() + seq[:, None], max=10.0))
    pg_losses = ppo_clip_loss(ratio, advantages, 1 - low, 1 + high)
    with torch.no_grad():
        clipfrac = _clip_frac(pg_losses, advantages, ratio, response_mask)
        ppo_kl = _masked_mean(-log_ratio, response_mask)
    return _finish(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, clipfrac, ppo_kl, 0.0)


def policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                      config=None, rollout_is_weights=None):
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A lp."""
    low, high = _clip_range(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped = cispo_weight(ratio, 1 - low, 1 + high)
    pg_losses = -clipped * advantages * log_prob
    with torch.no_grad():
        clipfrac = _masked_mean((ratio != clipped).float(), response_mask)
        ppo_kl = _masked_mean(-log_ratio, response_mask)
    return _finish(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights, clipfrac, ppo_kl, 0.0)


def policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                     config=None, rollout_is_weights=None):
    """SAPO: -sigmoid(tau (r - 1)) 4/tau A (soft gate), aggregated seq-mean-token-mean whatever the mode."""
    tau_pos, tau_neg = float(_cfg(config, "tau_pos", 1.0)), float(_cfg(config, "tau_neg", 1.05))
    log_ratio = _log_ratio(log_prob, old_log_prob)
    pg_losses = -sapo_gate(torch.exp(log_ratio), advantages, tau_pos, tau_neg) * advantages
    with torch.no_grad():
        ppo_kl = _masked_mean(-log_ratio, response_mask)
    return _finish(pg_losses, response_mask, "seq-mean-token-mean", config, rollout_is_weights, 0.0, ppo_kl, 0.0)


POLICY_LOSSES = {
    "vanilla": policy_loss_vanilla,
    "gspo": policy_loss_gspo,
    "cispo": policy_loss_cispo,
    "sapo": policy_loss_sapo,
}
PREFIX = "ludic_fast_"


def register_verl_policy_losses() -> list[str]:
    """Register `ludic_fast_<name>` for each of POLICY_LOSSES in verl's policy-loss registry; returns the names.

    Use with `actor_rollout_ref.actor.policy_loss.loss_mode=ludic_fast_cispo` (and verl's `external_lib` or
    an import of this module in the worker). Raises ImportError when verl is not installed.
    """
    from verl.trainer.ppo.core_algos import register_policy_loss

    names = []
    for name, fn in POLICY_LOSSES.items():
        register_policy_loss(PREFIX + name)(fn)
        names.append(PREFIX + name)
    return names


try:  # importing this module (e.g. through verl's external_lib) registers the losses when verl is present
    import verl.trainer.ppo.core_algos  # noqa: F401
except Exception:  # noqa: BLE001 - verl absent or not importable here: registration stays explicit
    pass
else:  # pragma: no cover - needs verl
    register_verl_policy_losses()


__all__ = [
    "FusedPPOOutput",
    "fused_ppo_forward",
    "patch_fused_forward",
    "unpatch_fused_forward",
    "aggregate",
    "policy_loss_vanilla",
    "policy_loss_gspo",
    "policy_loss_cispo",
    "policy_loss_sapo",
    "POLICY_LOSSES",
    "register_verl_policy_losses",
]
