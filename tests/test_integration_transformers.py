"""ludic_fast.integrations.transformers: hidden states + head of tiny random causal LMs (CPU, fp32)
reproduce log_softmax of the model's own logits, and gradients reach the model's parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ludic_fast
from ludic_fast.integrations.transformers import (
    LMHead,
    UnsupportedHeadError,
    call_head,
    call_in_forward,
    check_lm_head,
    final_hidden_states,
    get_decoder,
    lm_head,
)

transformers = pytest.importorskip("transformers", reason="transformers not installed")

TINY = dict(
    vocab_size=131, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)

CASES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "mistral": ("MistralConfig", {}),
    # a small softcap so that tanh is far from the identity on these logits
    "gemma2_softcap": ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 0.7}),
    "cohere_logit_scale": ("CohereConfig", {"logit_scale": 3.0}),
    "granite_logits_scaling": ("GraniteConfig", {"logits_scaling": 0.25}),
    "phi_bias": ("PhiConfig", {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
}


def tiny_model(config_name: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # larger logits than the default init, so scale/softcap/bias matter
        model.get_output_embeddings().weight.mul_(20.0)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            model.get_output_embeddings().bias.normal_(0.0, 1.0)
    return model


def batch(vocab: int = 131, B: int = 2, T: int = 7):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0  # left padding on one row
    return ids, mask


def model_logprobs(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()[:, :-1]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def fused_logprobs(model, ids, mask, **head_kw):
    hidden = final_hidden_states(model, ids, mask)[:, :-1]
    out = ludic_fast.linear_logprobs(hidden, targets=ids[:, 1:], backend="torch", **lm_head(model, **head_kw).kwargs())
    return out.logprobs, out.entropy


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_head_equals_model_logits(case):
    config_name, overrides = CASES[case]
    model = tiny_model(config_name, **overrides)
    ids, mask = batch()
    lp_ref, ent_ref = model_logprobs(model, ids, mask)
    lp, ent = fused_logprobs(model, ids, mask)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    assert check_lm_head(model, ids, mask) <= 1e-4


def test_head_post_processing_read_from_config():
    head = lm_head(tiny_model("Gemma2Config", head_dim=8, final_logit_softcapping=0.7))
    assert (head.logit_scale, head.softcap) == (1.0, 0.7)
    assert lm_head(tiny_model("CohereConfig", logit_scale=3.0)).logit_scale == 3.0
    assert lm_head(tiny_model("GraniteConfig", logits_scaling=0.25)).logit_scale == 4.0
    assert lm_head(tiny_model("PhiConfig")).bias is not None


def test_tied_embeddings_share_the_parameter_and_gradients_add():
    model = tiny_model("LlamaConfig", tie_word_embeddings=True)
    emb = model.get_input_embeddings().weight
    assert lm_head(model).weight is emb
    ids, mask = batch()
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(3))

    def grads(fn):
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, ids, mask)
        ((lp * w).sum() + 0.3 * ent.sum()).backward()
        return emb.grad.clone()

    torch.testing.assert_close(grads(fused_logprobs), grads(model_logprobs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["gemma2_softcap", "phi_bias"])
def test_gradients_to_model_parameters_equal_logits_path(case):
    config_name, overrides = CASES[case]
    model = tiny_model(config_name, **overrides)
    ids, mask = batch()
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(3))

    def grads(fn):
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, ids, mask)
        ((lp * w).sum() - 0.5 * ent.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused, ref = grads(fused_logprobs), grads(model_logprobs)
    assert fused.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(fused[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_fp32_head_casts_a_bf16_head_differentiably():
    model = tiny_model("LlamaConfig").to(torch.bfloat16)
    head = lm_head(model, fp32_head=True)
    assert head.weight.dtype == torch.float32 and head.weight.requires_grad
    ids, mask = batch()
    hidden = final_hidden_states(model, ids, mask)[:, :-1]
    assert hidden.dtype == torch.bfloat16
    out = head.logprobs(hidden, ids[:, 1:], backend="torch")
    ref = torch.log_softmax(hidden.float() @ head.weight.detach().T, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, ref, rtol=1e-5, atol=1e-5)
    out.logprobs.sum().backward()
    assert model.get_output_embeddings().weight.grad.dtype == torch.bfloat16


peft = pytest.importorskip("peft", reason="peft not installed")


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_peft_lora_model(targets):
    model = tiny_model("LlamaConfig")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    ids, mask = batch()
    lp_ref, ent_ref = model_logprobs(pm, ids, mask)
    lp, ent = fused_logprobs(pm, ids, mask)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)

    def lora_grads(fn):
        pm.zero_grad(set_to_none=True)
        lp, _ = fn(pm, ids, mask)
        lp.sum().backward()
        return {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}

    fused, ref = lora_grads(fused_logprobs), lora_grads(model_logprobs)
    assert any("lm_head" in n for n in ref) == ("lm_head" in targets)
    for name in ref:
        torch.testing.assert_close(fused[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_peft_lora_head_with_dropout_in_training_is_rejected():
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["lm_head"])
    pm = peft.get_peft_model(tiny_model("LlamaConfig"), cfg).train()
    with pytest.raises(UnsupportedHeadError, match="dropout"):
        lm_head(pm)


def test_unsupported_heads_raise_clear_errors():
    base = transformers.LlamaModel(transformers.LlamaConfig(**TINY))
    with pytest.raises(UnsupportedHeadError, match="output embeddings"):
        lm_head(base)
    model = tiny_model("LlamaConfig")
    model.lm_head = nn.Sequential(nn.Linear(32, 131))
    with pytest.raises(UnsupportedHeadError, match="not a linear layer"):
        lm_head(model)
    with pytest.raises(UnsupportedHeadError, match="base model"):
        get_decoder(nn.Linear(2, 2))


def test_check_lm_head_detects_an_unknown_post_processing():
    model = tiny_model("LlamaConfig")
    original = type(model).forward

    def forward(self, *args, **kwargs):  # an "architecture" that scales logits without a config attribute
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    model.forward = forward.__get__(model)
    ids, mask = batch()
    with pytest.raises(UnsupportedHeadError, match="differs from its logits"):
        check_lm_head(model, ids, mask)


def test_call_head_runs_fn_as_the_head_modules_forward_and_restores_it():
    model = tiny_model("LlamaConfig")
    seen = []
    hook = model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args))
    hidden = torch.randn(3, model.config.hidden_size)
    try:
        head, out = call_head(model, lambda h, x: (h, x * 2), hidden)
    finally:
        hook.remove()
    assert isinstance(head, LMHead) and head.weight is model.lm_head.weight
    assert len(seen) == 1 and seen[0][0] is hidden  # the module's hooks saw the call (ZeRO-3 gathers there)
    torch.testing.assert_close(out, hidden * 2)
    assert "forward" not in model.lm_head.__dict__ and model.lm_head(hidden).shape == (3, model.config.vocab_size)


class _Wrapper(nn.Module):
    """A DDP-like wrapper: `.module`, and work of its own around the inner forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, **inputs):
        self.calls += 1
        return self.module(**inputs)


def test_call_in_forward_runs_inside_the_wrappers_and_restores_the_forward():
    model = tiny_model("LlamaConfig")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    wrapped = _Wrapper(peft.get_peft_model(model, cfg))
    ids, mask = batch()

    def body(lm, *, input_ids, attention_mask):
        assert lm is model
        return fused_logprobs(lm, input_ids, attention_mask)

    lp, _ = call_in_forward(wrapped, body, input_ids=ids, attention_mask=mask)
    assert wrapped.calls == 1 and "forward" not in model.__dict__
    torch.testing.assert_close(lp, model_logprobs(wrapped.module, ids, mask)[0], rtol=1e-5, atol=1e-5)
