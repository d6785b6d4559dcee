"""VLLMEngine on a real vLLM (`make test` runs this file in .venv-vllm, with vLLM's CPU build): generation and
its EOS / length cuts against the transformers engine, seeded groups (distinct samples, reproducible), a
seeded batch beyond max_num_batched_tokens, behaviour log-probs against the model's own log_softmax(z / T),
weight pushes (plain, DDP, LoRA-merged names) that switch the engine to the new weights, and the trainer's
torch thread count. One engine serves the module (vLLM's in-process engine is built once: ~5 s)."""

from __future__ import annotations

import copy

import pytest
import torch
from _vllm import EOS, needs_vllm, tiny_sft_model

from ludic_fast.rollout.engine import HFGenerateEngine, SamplingConfig
from ludic_fast.rollout.vllm_engine import VLLMEngine, check_push_names, map_weights_for_vllm, request_seed

MAX_MODEL_LEN = 64
#: fp32 engine vs the model's own fp32 log_softmax(z / T): measured max abs diff ~1e-6 on this model
FP32_LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, trainer-side model, prompts): the SFT'd tiny Llama saved and served by vLLM in fp32, with a token
    budget of one max-length sequence; torch's thread count recorded around the engine's construction."""
    needs_vllm()
    model, tok, prompts = tiny_sft_model()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    set_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    engine = VLLMEngine(
        str(path), eos_token_id=EOS, seed=0, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
        max_num_batched_tokens=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20,
    )
    engine.threads_kept = (torch.get_num_threads() == threads, torch.set_num_threads is set_threads)
    return engine, model, prompts


def _model_logprobs(model, completions, temperature: float) -> list[torch.Tensor]:
    """log_softmax(z / T) of each completion token under `model` (the trainer's recomputation, plain torch)."""
    out = []
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1].double() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0])
    return out


def _max_logprob_diff(model, completions, temperature: float) -> float:
    ref = _model_logprobs(model, completions, temperature)
    return max(float((torch.tensor(c.logprobs, dtype=torch.float64) - r).abs().max()) for c, r in zip(completions, ref))


def test_building_the_engine_keeps_the_trainers_torch_threads(served):
    engine, _, _ = served
    count_kept, setter_kept = engine.threads_kept
    assert count_kept, "vLLM changed torch's thread count of the trainer's process"
    assert setter_kept, "vLLM left torch.set_num_threads replaced (a no-op) in the trainer's process"


def test_greedy_generation_and_its_eos_and_length_cuts_equal_the_transformers_engines(served):
    engine, model, prompts = served
    hf = HFGenerateEngine(model, pad_token_id=0, eos_token_id=EOS)
    for max_new in (2, 8):
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=max_new)
        ours, theirs = engine.generate(prompts[:16], sampling), hf.generate(prompts[:16], sampling)
        assert [c.completion_ids for c in ours] == [c.completion_ids for c in theirs]
        assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
        for a, b in zip(ours, theirs):
            assert a.prompt_ids == b.prompt_ids and len(a.logprobs) == len(a.completion_ids)
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=FP32_LOGPROB_TOL, rtol=0
            )
    greedy = engine.generate(prompts[:16], SamplingConfig(temperature=0.0, max_new_tokens=8))
    assert {c.finish_reason for c in greedy} == {"stop"}  # the SFT'd model ends its answers with eos ...
    cut = engine.generate(prompts[:16], SamplingConfig(temperature=0.0, max_new_tokens=1))
    assert {c.finish_reason for c in cut} == {"length"}  # ... which one new token cannot reach


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_models_log_softmax_of_z_over_t(served, temperature):
    engine, model, prompts = served
    completions = engine.generate(prompts[:24], SamplingConfig(temperature=temperature, max_new_tokens=6), seed=3)
    assert _max_logprob_diff(model, completions, temperature) < FP32_LOGPROB_TOL


def test_a_seeded_group_holds_distinct_samples_and_the_same_seed_samples_them_again(served):
    engine, _, _ = served
    # "3+": the model is unsure what follows at T = 2 (eight seeded transformers draws of 12 tokens gave 7-8
    # distinct completions in each of 20 trials); a group sharing one seed would give one
    group = [[7, 14]] * 8
    sampling = SamplingConfig(temperature=2.0, max_new_tokens=12)
    first, again = engine.generate(group, sampling, seed=11), engine.generate(group, sampling, seed=11)
    texts = [tuple(c.completion_ids) for c in first]
    assert len(set(texts)) >= 5, f"a seeded group collapsed to {len(set(texts))} distinct completion(s): {texts}"
    assert texts == [tuple(c.completion_ids) for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    other = [tuple(c.completion_ids) for c in engine.generate(group, sampling, seed=12)]
    assert other != texts


def test_a_seeded_batch_beyond_max_num_batched_tokens_samples_and_reproduces(served):
    engine, _, prompts = served
    batch = [p * 8 for p in prompts[:32]]  # 32 prompts of 24-40 tokens: ~1000 prompt tokens over a budget of 64
    assert sum(map(len, batch)) > MAX_MODEL_LEN * 10
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4)
    first, again = engine.generate(batch, sampling, seed=5), engine.generate(batch, sampling, seed=5)
    assert [c.completion_ids for c in first] == [c.completion_ids for c in again]
    assert all(len(c.completion_ids) >= 1 for c in first)


def test_generate_refuses_top_k_and_top_p(served):
    engine, _, prompts = served
    for sampling in (SamplingConfig(top_k=5), SamplingConfig(top_p=0.9)):
        with pytest.raises(ValueError, match="top_k / top_p"):
            engine.generate(prompts[:1], sampling, seed=0)


def _perturbed(model, seed: int):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return new


def _lora_merged(model, seed: int):
    """(params as Trainer.push_weights publishes them for a PEFT model: adapters merged, lora_A/B included, the
    plain model with those merged weights)."""
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    wrapped.merge_adapter()
    params = {k: v.detach().clone() for k, v in wrapped.named_parameters()}
    return params, wrapped.merge_and_unload().eval()


def _pushes(model):
    plain = _perturbed(model, 1)
    ddp = _perturbed(model, 2)
    lora_params, lora_model = _lora_merged(model, 3)
    return [
        ("plain", dict(plain.named_parameters()), plain),
        ("ddp", {"module." + k: v for k, v in ddp.named_parameters()}, ddp),
        ("lora_merged", lora_params, lora_model),
    ]


def test_a_push_switches_the_engine_to_the_new_weights_plain_ddp_and_lora_merged_names(served):
    engine, model, prompts = served
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    try:
        for kind, params, new_model in _pushes(model):
            engine.publish(params, version=7)
            completions = engine.generate(prompts[:16], sampling, seed=1)
            assert _max_logprob_diff(new_model, completions, 1.0) < FP32_LOGPROB_TOL, kind
            assert _max_logprob_diff(model, completions, 1.0) > 1e-2, kind  # ... and no longer the old ones
            assert engine.version == 7
    finally:
        engine.publish(dict(model.named_parameters()), version=0)
    assert _max_logprob_diff(model, engine.generate(prompts[:8], sampling, seed=1), 1.0) < FP32_LOGPROB_TOL


def test_a_wrong_name_mapping_fails_the_logprob_check(served, monkeypatch):
    """The check above catches a mapping that loads tensors into the wrong places: swap layer 0's q and k."""
    import ludic_fast.rollout.vllm_engine as ve

    engine, model, prompts = served
    new_model = _perturbed(model, 4)
    swap = {"model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.k_proj.weight"}
    swap.update({v: k for k, v in swap.items()})
    right = ve.vllm_weight_name
    monkeypatch.setattr(ve, "vllm_weight_name", lambda n: swap.get(right(n), right(n)))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    try:
        engine.publish(dict(new_model.named_parameters()), version=1)
        assert _max_logprob_diff(new_model, engine.generate(prompts[:16], sampling, seed=1), 1.0) > 1e-3
    finally:
        monkeypatch.setattr(ve, "vllm_weight_name", right)
        engine.publish(dict(model.named_parameters()), version=0)


def test_a_push_with_unknown_or_missing_names_is_refused_before_anything_loads(served):
    engine, model, prompts = served
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    new = _perturbed(model, 5)
    nested = {"module.module." + k: v for k, v in new.named_parameters()}
    with pytest.raises(ValueError, match="is not a tensor of the served checkpoint"):
        engine.publish(nested, version=3)
    partial = {k: v for k, v in new.named_parameters() if "embed_tokens" not in k}
    with pytest.raises(ValueError, match="lacks 'model.embed_tokens.weight'"):
        engine.publish(partial, version=3)
    assert engine.version == 0
    assert _max_logprob_diff(model, engine.generate(prompts[:8], sampling, seed=1), 1.0) < FP32_LOGPROB_TOL


def test_checkpoint_names_leave_out_a_tied_lm_head(tmp_path):
    from safetensors.torch import save_file

    from ludic_fast.rollout.vllm_engine import checkpoint_tensor_names

    tensors = {"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(2, 2)}
    save_file(tensors, tmp_path / "model.safetensors")
    assert checkpoint_tensor_names(str(tmp_path)) == set(tensors)
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    assert checkpoint_tensor_names(str(tmp_path)) == {"model.embed_tokens.weight"}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        checkpoint_tensor_names(str(empty))


@pytest.mark.parametrize("tie", [None, False], ids=["key-missing", "false"])
def test_checkpoint_names_keep_the_lm_head_of_an_untied_config(tmp_path, tie):
    """A checkpoint of an untied model whose config.json lacks tie_word_embeddings or sets it false: the names a
    push must carry are the parameters of the model transformers loads from it, lm_head.weight included (a full
    push is accepted). A config.json of `{}` reads untied too, as transformers' own default (a model without the
    key ties nothing)."""
    import json

    from transformers import AutoModelForCausalLM

    from ludic_fast.embedded import build_tiny_model
    from ludic_fast.rollout.vllm_engine import checkpoint_tensor_names

    build_tiny_model(40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings")
    if tie is not None:
        config["tie_word_embeddings"] = tie
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert checkpoint_tensor_names(str(tmp_path)) == {name for name, _ in model.named_parameters()}
    (tmp_path / "config.json").write_text("{}")
    assert "lm_head.weight" in checkpoint_tensor_names(str(tmp_path))

def test_push_name_checks_and_request_seeds_without_an_engine():
    names = frozenset({"model.norm.weight", "lm_head.weight"})
    check_push_names({"model.norm.weight", "lm_head.weight"}, names)
    with pytest.raises(ValueError, match="'model.nrm.weight'"):
        check_push_names({"model.nrm.weight", "lm_head.weight"}, names)
    with pytest.raises(ValueError, match="lacks 'lm_head.weight'"):
        check_push_names({"model.norm.weight"}, names)
    mapped = map_weights_for_vllm({"base_model.model.model.layers.0.q_proj.base_layer.weight": torch.ones(1),
                                   "base_model.model.model.layers.0.q_proj.lora_A.default.weight": torch.ones(1)})
    assert list(mapped) == ["model.layers.0.q_proj.weight"]
    seeds = [request_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64 and seeds == [request_seed(7, i) for i in range(64)]
    assert all(0 <= s < 2**63 for s in seeds) and request_seed(8, 0) != seeds[0]
