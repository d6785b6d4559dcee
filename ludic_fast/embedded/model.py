"""A tiny Llama-architecture causal LM built from a `LlamaConfig` (random init, seeded, no download)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_MODEL_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def build_tiny_model(
    vocab_size: int,
    *,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
    bos_token_id: int = 1,
    seed: int = 0,
    **overrides: Any,
) -> LlamaForCausalLM:
    """`LlamaForCausalLM(LlamaConfig(**(TINY_MODEL_DEFAULTS | overrides)))`, initialised under manual_seed(seed)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        **{**TINY_MODEL_DEFAULTS, **overrides},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model
