"""Ludic users: keep your loss class, arguments and collated batch; pass the model instead of its logits.

    # Ludic                                            # ludic_fast
    from ludic.training.loss import CISPOLoss          from ludic_fast.losses import CISPOLoss
    logits = model(input_ids=..., attention_mask=...).logits.float()
    loss, stats = loss_fn.compute(logits, batch)       loss, stats = compute_loss(model, loss_fn, batch)

    .venv/bin/python examples/ludic_swap.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ludic_fast import reference
from ludic_fast.integrations.ludic import compute_loss
from ludic_fast.losses import CISPOLoss


def collated_batch(vocab: int) -> dict[str, torch.Tensor]:
    """What Ludic's collate_saw_items returns for 2 items (right padding, float32 masks)."""
    input_ids = torch.randint(1, vocab, (2, 8))
    input_ids[1, 6:] = 0
    attention_mask = (torch.arange(8) < torch.tensor([[8], [6]])).long()
    action_mask = attention_mask.float()
    action_mask[:, :3] = 0.0  # prompt tokens
    actor_logps = torch.where(action_mask > 0, torch.full((2, 8), -3.0), torch.zeros(2, 8))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask,
            "weight": torch.tensor([1.0, -1.0]), "actor_logps": actor_logps,
            "old_logp_action": actor_logps.sum(-1)}


def main() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=503, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4))
    batch = collated_batch(503)
    loss_fn = CISPOLoss(clip_eps_high=0.2)  # Ludic's arguments and defaults
    loss, stats = compute_loss(model, loss_fn, batch)
    loss.backward()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        ref_loss, _ = reference.CISPOLoss(clip_eps_high=0.2)(batch, logits=logits)
    print(f"fused loss {loss.item():.6f}   Ludic-semantics reference on logits {ref_loss.item():.6f}")
    print({k: round(float(v), 4) for k, v in stats.items()})


if __name__ == "__main__":
    main()
