"""TRL drop-in: `FastGRPOTrainer`, a `trl.GRPOTrainer` whose loss comes from hidden states and ludic_fast's head.

`compute_loss` is overridden (so a code path that skips `_compute_loss` cannot bypass it): one forward of
the base model gives the final hidden states at the completion positions, and TRL's GRPO objective is
evaluated on the per-token logprobs lp and entropies H of ludic_fast's fused head, never holding the
`[B, C, V]` logits. With `ratio r = exp(lp - old)` (token level) or `exp(mean_seq(lp - old))` (sequence
level), A the advantage, m = completion_mask * tool_mask, TRL 1.16's per-token loss is

    cispo:                       -sg(min(r, eps_high)) A lp
    grpo/bnpo/dr_grpo/dapo/luspo: -min(min(r, delta) A, clip(r, 1-eps_low, 1+eps_high) A)   (delta optional)
    sapo:                        -sigmoid(tau (r - 1)) 4/tau A,   tau = tau_pos if A > 0 else tau_neg
    vespo:                       -phi A lp,   phi the detached gamma weight of the sequence ratio

times the off-policy sequence mask, the top-entropy token mask and the vLLM importance-sampling ratio
(all constants), plus beta * k3(ref, lp) (times r with `use_bias_correction_kl`), aggregated with TRL's
normaliser per loss_type (GA = gradient-accumulation steps in training, 1 in eval):

    grpo, sapo:          mean_b(sum_t l m / max(|m_b|, 1)) / GA       bnpo:  sum l m / max(sum m, 1) / GA
    dr_grpo:             sum l m / (B * max_completion_length) / GA    luspo: mean_b(sum_t l m) / GA
    dapo, cispo, vespo:  sum l m / (max(num_items, 1) / processes * GA / steps_per_generation)

and minus `entropy_coef * sum(H m') / max(sum m', 1) / GA` (m' = m times the entropy mask) when the
entropy bonus is on (static or TRL's adaptive controller). Metrics are logged under TRL's names.

Cost: when every term is token-local (token-level ratios, no off-policy mask, no top-entropy mask, not
vespo: TRL's default dapo included) the gradient is formed in the forward pass, `6NDV` matmul FLOPs for
forward + backward; otherwise two passes, `8NDV` (TRL's own chunked head is `8NDV` in every case).

Not supported (ValueError at construction or call, never a silent fallback): MoE router aux loss,
multimodal inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.integrations.transformers import LMHead, call_head, call_in_forward, final_hidden_states
from ludic_fast.losses.policy_terms import cispo_weight, kl_estimate, ppo_clip_loss, sapo_gate
from ludic_fast.ops.fused_loss import FusedPlan, fused_head_loss
from ludic_fast.ops.torch_head import HeadTransform

try:
    from trl import GRPOTrainer
    from trl.trainer.utils import nanmax, nanmin
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError("ludic_fast.integrations.trl needs TRL: pip install 'ludic-fast[trl]'") from exc

_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_LOG_PROB_LOSSES = ("cispo", "vespo")
_NUM_ITEMS_NORMALISED = ("cispo", "dapo", "vespo")
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def _head_rows(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor, n_keep: int) -> Tensor:
    """Hidden states [B, n_keep, D] at the positions that score the last `n_keep` tokens."""
    hidden = final_hidden_states(lm, input_ids, attention_mask)
    return hidden[:, -n_keep - 1 : -1]


def _transform(head: LMHead, temperature: float, n_tokens: int, device: torch.device) -> HeadTransform:
    return HeadTransform.build(head.logit_scale, head.softcap, temperature, n_tokens, device)


class FastGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with the loss (and every logprob TRL computes) from ludic_fast's fused head.

    Same constructor, config and metrics as `GRPOTrainer`; see the module docstring for the objective.
    Old and reference logprobs (`_get_per_token_logps_and_entropies`) use the same head, so the ratio of
    an on-policy step is exactly 1.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "FastGRPOTrainer: the MoE router aux loss (router_aux_loss_coef != 0) is not supported; "
                "set router_aux_loss_coef=0"
            )

    # --- logprobs for generation-time old/ref logps ------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            raise ValueError("FastGRPOTrainer: multimodal inputs and the MoE aux loss are not supported")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            fn = functools.partial(self._head_logprobs, n_keep=logits_to_keep, with_entropy=compute_entropy)
            lp, ent = call_in_forward(model, fn, input_ids=ids, attention_mask=am)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def _head_logprobs(self, lm, *, input_ids, attention_mask, n_keep, with_entropy):
        with self.accelerator.autocast():
            hidden = _head_rows(lm, input_ids, attention_mask, n_keep)
        targets = input_ids[:, -n_keep:].masked_fill(attention_mask[:, -n_keep:] == 0, -100)

        def head_logprobs(head: LMHead, h: Tensor) -> tuple[Tensor, Tensor | None]:
            with torch.autocast(h.device.type, enabled=False):
                out = head.logprobs(h, targets, temperature=self.temperature, entropy=with_entropy)
            return out.logprobs, out.entropy

        return call_head(lm, head_logprobs, hidden)

    # --- the loss ---------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        present = [k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None]
        if present:
            raise ValueError(f"FastGRPOTrainer: multimodal inputs are not supported (got {present})")
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        fn = functools.partial(self._fused_loss, loss_inputs=inputs)
        return call_in_forward(model, fn, input_ids=input_ids, attention_mask=attention_mask)

    def _token_local(self) -> bool:
        return (
            self.importance_sampling_level == "token"
            and self.loss_type != "vespo"
            and self.off_policy_mask_threshold is None
            and self.top_entropy_quantile >= 1.0
        )

    def _fused_loss(self, lm, *, input_ids, attention_mask, loss_inputs):
        inputs = loss_inputs
        completion_mask = inputs["completion_mask"]
        B, C = completion_mask.shape
        mode = "train" if self.model.training else "eval"
        with self.accelerator.autocast():
            hidden = _head_rows(lm, input_ids, attention_mask, C)
        targets = inputs["completion_ids"].masked_fill(completion_mask == 0, -100)
        objective = _GRPOObjective(self, inputs, mode)

        def head_loss(head: LMHead, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            with torch.autocast(h.device.type, enabled=False):
                if not torch.is_grad_enabled():
                    out = head.logprobs(h, targets, temperature=self.temperature)
                    lp, ent = out.logprobs.reshape(-1), out.entropy.reshape(-1)
                    return objective(lp, ent, None), lp, ent
                plan = FusedPlan(
                    transform=_transform(head, self.temperature, B * C, h.device),
                    objective=objective,
                    coupled=not self._token_local(),
                    with_entropy=True,
                )
                return fused_head_loss(h.reshape(B * C, -1), head.weight, head.bias, targets.reshape(-1), plan)

        loss, lp, ent = call_head(lm, head_loss, hidden)
        lp = lp.detach().view(B, C) * objective.valid
        ent = ent.detach().view(B, C) * objective.valid
        self._log_loss_metrics(objective, lp, ent, mode)
        return loss

    # --- metrics (TRL's names and reductions) -----------------------------------------------------------------

    def _log_loss_metrics(self, obj: _GRPOObjective, lp: Tensor, ent: Tensor, mode: str) -> None:
        parts = obj.parts(lp, ent)
        metrics = self._metrics[mode]
        mask = obj.mask
        if self._entropy_bonus_enabled:
            metrics["policy_loss"].append(self.accelerator.gather(parts["policy_loss"]).nanmean().item())
            self._update_adaptive_entropy(ent, parts["effective_mask"], mode)
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)

        def seq_mean(x: Tensor) -> Tensor:
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        def global_mean(x: Tensor) -> float:
            if x.shape[1] == 1:
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum().float()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            metrics["kl"].append(global_mean(parts["kl"]))
        metrics["entropy"].append(global_mean(ent))
        coef_1, adv = parts["coef_1"], obj.adv
        if self.loss_type in _CLIPPED:
            low = ((coef_1 < 1 - self.epsilon_low) & (adv < 0)).float()
            high = ((coef_1 > 1 + self.epsilon_high) & (adv > 0)).float()
            metrics["clip_ratio/low_mean"].append(global_mean(low))
            metrics["clip_ratio/high_mean"].append(global_mean(high))
            metrics["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))
            metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(seq_mean(low))).item())
            metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(seq_mean(high))).item())
        elif self.loss_type == "cispo":
            metrics["cispo_clip_ratio"].append(global_mean(((coef_1 > self.epsilon_high) & (adv > 0)).float()))
        elif self.loss_type == "vespo":
            metrics["vespo/phi_seq_mean"].append(global_mean(parts["phi"]))

    def _update_adaptive_entropy(self, ent: Tensor, effective_mask: Tensor, mode: str) -> None:
        """TRL's adaptive entropy controller: window-global token mean entropy vs `entropy_target`."""
        if not (self.use_adaptive_entropy and mode == "train"):
            return
        stats = torch.stack([(ent * effective_mask).sum(), effective_mask.sum()]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if self.accelerator.sync_gradients:
            window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            step = self.args.entropy_coef_delta
            if world_entropy <= self.args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
            self._last_world_entropy = world_entropy
            self._entropy_window_stats = None


class _GRPOObjective:
    """TRL 1.16's GRPO objective as a function of per-token (lp, H): `objective(lp, H, rows) -> loss`.

    `rows=None`: lp, H are all B*C tokens (sequence-coupled terms allowed); a slice: a chunk of the
    flattened tokens (token-local configurations only). Constants are [B, C] tensors, flattened for chunks.
    """

    def __init__(self, trainer: FastGRPOTrainer, inputs: dict[str, Any], mode: str):
        self.t = trainer
        completion_mask = inputs["completion_mask"]
        self.shape = completion_mask.shape
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        self.mask = mask
        self.valid = completion_mask.to(torch.float32)
        adv = inputs["advantages"]
        self.adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        self.old = inputs.get("old_per_token_logps")
        self.ref = inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None
        self.sampling = inputs.get("sampling_per_token_logps")
        self.is_ratio = inputs.get("importance_sampling_ratio")
        self.use_is = trainer.use_vllm and trainer.vllm_importance_sampling_correction and trainer.loss_type != "vespo"
        self.ga = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        self.omega = self._token_weights(inputs, mode)
        self.bonus_coef = self._bonus_coef()

    # constants

    def _token_weights(self, inputs: dict[str, Any], mode: str) -> Tensor:
        """Per-token weight of the per-token loss in TRL's aggregation (mask and normaliser folded in)."""
        t, m = self.t, self.mask.to(torch.float32)
        B = m.shape[0]
        if t.loss_type in ("grpo", "sapo"):
            return m / m.sum(-1, keepdim=True).clamp(min=1.0) / B / self.ga
        if t.loss_type == "bnpo":
            return m / m.sum().clamp(min=1.0) / self.ga
        if t.loss_type == "dr_grpo":
            return m / (B * t.max_completion_length) / self.ga
        if t.loss_type in _NUM_ITEMS_NORMALISED:
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / t.accelerator.num_processes
            if mode == "train":
                normaliser = normaliser * t.current_gradient_accumulation_steps / t.args.steps_per_generation
            return m / normaliser
        if t.loss_type == "luspo":
            return m / B / self.ga
        raise ValueError(f"Unknown loss type: {t.loss_type}")

    def _bonus_coef(self) -> float:
        t = self.t
        if not t._entropy_bonus_enabled:
            return 0.0
        if t.use_adaptive_entropy:
            return t.entropy_coef if t._last_world_entropy <= t.args.entropy_target else 0.0
        return t.entropy_coef

    def _expand(self, x: Tensor | None, rows: slice | None) -> Tensor | None:
        """x broadcast to [B, C] (rows None) or the chunk `rows` of its flattened [B*C] view."""
        if x is None or rows is None:
            return x
        return x.expand(self.shape).reshape(-1)[rows]

    # the objective

    def _terms(self, lp: Tensor, H: Tensor, rows: slice | None) -> dict[str, Tensor]:
        t = self.t
        if rows is None:
            lp, H = lp.reshape(self.shape), H.reshape(self.shape)
        valid = self._expand(self.valid, rows)
        lp, H = lp * valid, H * valid  # TRL's head gives lp = H = 0 on padded completion positions
        mask = self._expand(self.mask, rows)
        adv = self._expand(self.adv, rows)
        old = lp.detach() if self.old is None else self._expand(self.old, rows)
        log_ratio = lp - old
        if t.importance_sampling_level == "token":
            coef_1 = torch.exp(log_ratio)
        elif t.importance_sampling_level == "sequence":
            seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
            coef_1 = torch.exp(seq)
        else:
            raise ValueError(f"Unknown importance sampling level: {t.importance_sampling_level}")
        phi = None
        if t.loss_type == "vespo":
            phi = t.get_gamma_weights(
                advantages=adv, log_ratio_per_token=log_ratio, mask=mask,
                importance_sampling_ratio=self.is_ratio, k_pos=t.args.vespo_k_pos,
                lambda_pos=t.args.vespo_lambda_pos, k_neg=t.args.vespo_k_neg, lambda_neg=t.args.vespo_lambda_neg,
            )
        per_token = self._policy(coef_1, lp, adv, phi)
        if t.off_policy_mask_threshold is not None:
            sampling = old if self.sampling is None else self.sampling
            per_token = per_token * t.get_off_policy_mask(adv, lp, sampling, mask, t.off_policy_mask_threshold)
        effective_mask = mask
        if t.top_entropy_quantile < 1.0:
            entropy_mask = t.get_high_entropy_mask(H.detach(), mask, 1 - t.top_entropy_quantile)
            per_token = per_token * entropy_mask
            effective_mask = mask * entropy_mask
        if self.use_is:
            per_token = per_token * self._expand(self.is_ratio, rows)
        kl = None
        if t.beta != 0.0:
            ref = self._expand(self.ref, rows)
            kl = kl_estimate(lp - ref, "k3")
            if t.args.use_bias_correction_kl:
                kl = kl * coef_1
            per_token = per_token + t.beta * kl
        policy = (per_token * self._expand(self.omega, rows)).sum()
        return {"policy": policy, "coef_1": coef_1, "kl": kl, "phi": phi, "effective_mask": effective_mask,
                "H": H}

    def _policy(self, coef_1: Tensor, lp: Tensor, adv: Tensor, phi: Tensor | None) -> Tensor:
        t = self.t
        if t.loss_type == "cispo":
            return -cispo_weight(coef_1, None, t.epsilon_high) * adv * lp
        if t.loss_type in _CLIPPED:
            return ppo_clip_loss(coef_1, adv, 1 - t.epsilon_low, 1 + t.epsilon_high, ratio_cap=t.args.delta)
        if t.loss_type == "sapo":
            return -sapo_gate(coef_1, adv, t.args.sapo_temperature_pos, t.args.sapo_temperature_neg) * adv
        if t.loss_type == "vespo":
            return -phi * adv * lp
        raise ValueError(f"Unknown loss type: {t.loss_type}")

    def __call__(self, lp: Tensor, H: Tensor | None, rows: slice | None) -> Tensor:
        terms = self._terms(lp, H, rows)
        if self.bonus_coef == 0.0:
            return terms["policy"]
        # entropy bonus: coef * masked mean entropy over the effective mask, / GA; a chunk (token-local, so no
        # entropy mask) is normalised by the whole batch's mask count
        m = terms["effective_mask"]
        count = (m if rows is None else self.mask).sum().clamp(min=1.0)
        return terms["policy"] - self.bonus_coef * (terms["H"] * m).sum() / count / self.ga

    def parts(self, lp: Tensor, H: Tensor) -> dict[str, Tensor]:
        """Detached terms for the metrics, from the head's lp, H [B, C]."""
        with torch.no_grad():
            terms = self._terms(lp.reshape(-1), H.reshape(-1), None)
        factor = 1.0 if self.t.loss_type in _NUM_ITEMS_NORMALISED else self.ga
        terms["policy_loss"] = terms["policy"] * factor
        return terms


__all__ = ["FastGRPOTrainer"]
