"""verl drop-in pieces on a tiny model: the fused forward (log_probs + entropy from hidden states) and a
registered policy loss, exactly as verl's actor uses them with `use_fused_kernels=True`.

    .venv/bin/python examples/verl_fused_forward.py        # without verl: our function directly
    .venv-verl/bin/python examples/verl_fused_forward.py   # with verl: the loss fetched from verl's registry

In a verl run: import `ludic_fast.integrations.verl` in the workers (verl's `external_lib`), call
`patch_fused_forward(model)` where verl would apply its own fused-kernel patch, and set
`actor_rollout_ref.actor.policy_loss.loss_mode=ludic_fast_cispo` (or _vanilla, _gspo, _sapo).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ludic_fast.integrations.verl import patch_fused_forward, policy_loss_cispo


def cispo_loss_fn():
    """verl's registered `ludic_fast_cispo` when verl is importable (as its actor looks it up), else ours."""
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
    except ImportError:
        return policy_loss_cispo, "ludic_fast.integrations.verl.policy_loss_cispo"
    return get_policy_loss_fn("ludic_fast_cispo"), "verl get_policy_loss_fn('ludic_fast_cispo')"


def main() -> None:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=1021, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16))
    patch_fused_forward(model)
    B, P, R = 4, 6, 10  # prompts and responses, as verl lays them out
    input_ids = torch.randint(0, 1021, (B, P + R))
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), temperature=0.9)
    log_prob = out.log_probs[:, -R - 1 : -1]  # verl's slice: the positions that score the response
    entropy = out.entropy[:, -R - 1 : -1]
    old_log_prob = log_prob.detach() + 0.1 * torch.randn(B, R)
    advantages = torch.randn(B, 1).expand(B, R)
    mask = torch.ones(B, R)
    loss_fn, source = cispo_loss_fn()
    print(f"policy loss from {source}")
    loss, metrics = loss_fn(old_log_prob, log_prob, advantages, mask, "token-mean",
                                      {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})
    loss.backward()
    print(f"loss {loss.item():.5f}  entropy {entropy.mean().item():.4f}  metrics {metrics}")
    print(f"|grad lm_head| {model.lm_head.weight.grad.norm().item():.5f}")


if __name__ == "__main__":
    main()
