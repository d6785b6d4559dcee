"""vLLM engine: the trainer -> vLLM weight-name mapping (CPU) and one in-process generation + weight sync (GPU)."""

from __future__ import annotations

import pytest
import torch

from ludic_fast.rollout.vllm_engine import map_weights_for_vllm, vllm_weight_name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", "model.layers.0.mlp.up_proj.weight"),
        ("base_model.model.base_model.model.lm_head.weight", "lm_head.weight"),
        ("model.model.norm.weight", "model.norm.weight"),
        ("layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"),
        ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("model.layers.0.mlp.lora.B", None),
    ],
)
def test_weight_name_mapping(name, expected):
    assert vllm_weight_name(name) == expected


def test_mapping_of_a_peft_model_state():
    peft = pytest.importorskip("peft", reason="peft not installed")
    from _trainer_fixtures import tiny_model

    base = tiny_model()
    plain = {k for k, _ in base.named_parameters()}
    wrapped = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    mapped = map_weights_for_vllm(dict(wrapped.named_parameters()))
    assert set(mapped) == plain
    with pytest.raises(ValueError, match="maps to"):
        map_weights_for_vllm({"model.norm.weight": torch.zeros(1), "model.model.norm.weight": torch.zeros(1)})


@pytest.mark.gpu
def test_vllm_engine_generates_and_syncs_weights(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="vllm not installed")
    from _trainer_fixtures import TOKENIZER, tiny_model

    from ludic_fast.rollout import SamplingConfig
    from ludic_fast.rollout.vllm_engine import VLLMEngine

    model = tiny_model()
    model.save_pretrained(tmp_path)
    TOKENIZER.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), eos_token_id=TOKENIZER.eos_token_id, dtype="float32", enforce_eager=True)
    prompts = [TOKENIZER("1+2=")["input_ids"]] * 4
    outs = engine.generate(prompts, SamplingConfig(temperature=0.7, max_new_tokens=4), seed=0)
    assert len(outs) == 4 and all(len(o.logprobs) == len(o.completion_ids) > 0 for o in outs)
    engine.publish({k: v.cuda() for k, v in model.named_parameters()}, version=3)
    assert engine.version == 3
