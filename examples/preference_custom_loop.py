"""DPO and distillation in your own training loop: hidden states + the LM head instead of logits.

    .venv/bin/python examples/preference_custom_loop.py

1. DPO: pairs collated chosen/rejected side by side (`collate_pairs`), the reference model's log-probs once per
   batch under no_grad through the same fused head, `DPOLoss(batch, hidden=, weight=)`; checked against the
   materialised-logits twin on the first batch.
2. Distillation: `linear_divergence` between a student and a teacher of another width, on the response tokens.
Tiny Llamas built from configs (no download), CPU, a few seconds.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ludic_fast import linear_divergence, reference
from ludic_fast.data.pair_batching import PreferencePair, collate_completions, collate_pairs
from ludic_fast.integrations.transformers import final_hidden_states, lm_head
from ludic_fast.losses import DPOLoss


def tiny_llama(hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def ref_logps(ref: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p_ref of each response token at its position ([B, T], 0 elsewhere)."""
    ids = batch["input_ids"]
    targets = torch.where(batch["action_mask"][:, 1:] > 0, ids[:, 1:], -100)
    with torch.no_grad():
        hidden = final_hidden_states(ref, input_ids=ids, attention_mask=batch["attention_mask"])
        out = torch.zeros(ids.shape)
        out[:, 1:] = lm_head(ref).logprobs(hidden[:, :-1], targets, entropy=False).logprobs
    return out


def dpo(steps: int = 20) -> None:
    g = torch.Generator().manual_seed(0)
    pairs = [PreferencePair(torch.randint(4, 64, (5,), generator=g).tolist(), [7, 8, 9], [10, 11])
             for _ in range(8)]
    policy = tiny_llama(64, seed=0)
    ref = copy.deepcopy(policy).requires_grad_(False)
    loss_fn = DPOLoss(beta=0.1)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for step in range(steps):
        batch = collate_pairs(pairs)
        batch["ref_logps"] = ref_logps(ref, batch)
        hidden = final_hidden_states(policy, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss, stats = loss_fn(batch, hidden=hidden, **lm_head(policy).kwargs())
        if step == 0:  # the same number from materialised logits (what the fused head never builds)
            twin, _ = reference.DPOLoss(beta=0.1)(batch, logits=policy.lm_head(hidden))
            assert torch.allclose(loss, twin, rtol=1e-5), (loss, twin)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            print(f"dpo step {step:2d}: loss {float(loss.detach()):.4f}  margin {float(stats['rewards_margin']):+.3f}  "
                  f"accuracy {float(stats['rewards_accuracy']):.2f}")


def distill(steps: int = 20) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 64, (4,), generator=g).tolist() for _ in range(8)]
    completions = [torch.randint(4, 64, (3,), generator=g).tolist() for _ in range(8)]
    student, teacher = tiny_llama(64, seed=1), tiny_llama(96, seed=2).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    batch = collate_completions(prompts, completions)
    sel = (batch["action_mask"][:, 1:] > 0).reshape(-1)
    kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ht = final_hidden_states(teacher, **kw)[:, :-1].reshape(-1, 96)[sel]
    for step in range(steps):
        hs = final_hidden_states(student, **kw)[:, :-1].reshape(-1, 64)[sel]
        loss = linear_divergence(hs, student.lm_head.weight, ht, teacher.lm_head.weight, kind="jsd", beta=0.5)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == steps - 1:
            print(f"distill step {step:2d}: JSD {float(loss.detach()):.5f}")


if __name__ == "__main__":
    dpo()
    distill()
