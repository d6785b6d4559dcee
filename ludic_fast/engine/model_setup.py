"""What the engine does to the models before training: LoRA, Liger body kernels, gradient checkpointing,
the packed-attention path and `torch.compile` of the decoder layers (`EngineConfig` documents each)."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch
from torch import nn

from ludic_fast.engine.config import EngineConfig
from ludic_fast.integrations.body_kernels import apply_body_kernels, compile_body
from ludic_fast.integrations.packing import (
    PackedAttention,
    auto_attention,
    check_packed_attention,
    half_precision_compute,
    resolve_packed_attention,
    use_sdpa_varlen,
)


def with_lora(model: nn.Module, lora_config: Any) -> nn.Module:
    """`model` wrapped by PEFT with `lora_config` (only the adapters train); unchanged when None."""
    if lora_config is None:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora_config)


def body_kernels(cfg: EngineConfig, device: torch.device, models: list[nn.Module]) -> Any:
    """Liger's body kernels on every model: `body_kernels` True, or None on CUDA. Returns the policy's
    applied `BodyKernelPlan` (None: off, Liger missing under auto, or no patch for the type)."""
    wanted = cfg.body_kernels if cfg.body_kernels is not None else device.type == "cuda"
    if not wanted:
        return None
    if cfg.body_kernels is None and importlib.util.find_spec("liger_kernel") is None:
        warnings.warn("body_kernels (auto on CUDA): liger-kernel is not installed; the body runs unfused", stacklevel=3)
        return None
    plan = apply_body_kernels(models[0])
    if plan is not None:
        for m in models[1:]:
            apply_body_kernels(m)
    return plan


def enable_gradient_checkpointing(model: nn.Module) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    if enable is None:
        raise ValueError("gradient_checkpointing needs a transformers model (gradient_checkpointing_enable)")
    enable()
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def packed_attention(cfg: EngineConfig, device: torch.device, amp_dtype: torch.dtype | None,
                     model: nn.Module) -> PackedAttention:
    """The packed-attention path of `model` (`integrations.packing`), probed when `check_packing`. Under
    `packed_attention="auto"` an eager / sdpa model is first moved to flash-attention-2 or flex attention
    (CUDA) or per-sequence SDPA (`auto_attention`); `"sdpa_varlen"` moves it to per-sequence SDPA."""
    if cfg.packed_attention == "auto":
        half = half_precision_compute(model, amp_dtype)
        auto_attention(model, device, half=half, max_seq_len=cfg.max_seq_len)
    elif cfg.packed_attention == "sdpa_varlen":
        use_sdpa_varlen(model)
    packing = resolve_packed_attention(model, path=cfg.packed_attention, device=device, max_seq_len=cfg.max_seq_len)
    if cfg.check_packing:
        check_packed_attention(model, packing, autocast_dtype=amp_dtype)
    return packing


def compile_layers(cfg: EngineConfig, models: list[nn.Module]) -> None:
    """`torch.compile` each decoder layer of every model (`compile_body`: True = inductor, or a backend)."""
    if cfg.compile_body:
        backend = "inductor" if cfg.compile_body is True else cfg.compile_body
        for m in models:
            compile_body(m, backend=backend)


__all__ = ["with_lora", "body_kernels", "enable_gradient_checkpointing", "packed_attention", "compile_layers"]
