"""The engine's settings (`EngineConfig`) and the pad-token resolution it needs. The RL objective's settings
live beside it (`ludic_fast.objectives.rl.RLConfig`); `ludic_fast.trainer.TrainerConfig` is the two together."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ludic_fast.integrations.body_kernels import check_body_kernels_device
from ludic_fast.integrations.packing import PACKED_ATTENTION_PATHS
from ludic_fast.ops.budget import parse_memory_budget

_SCHEDULES = ("constant", "linear", "cosine")
#: mixed_precision_dtype names -> autocast dtype
MIXED_PRECISION = {
    None: None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_pad_token_id(value: Any) -> int:
    """An int, or a tokenizer's pad_token_id (falling back to eos_token_id); ValueError otherwise."""
    if isinstance(value, bool):
        raise TypeError("pad_token_id must be an int or a tokenizer")
    if isinstance(value, int):
        return value
    if value is None:
        raise ValueError("pad_token_id is required (an int, or a tokenizer to read it from)")
    for attr in ("pad_token_id", "eos_token_id"):
        tid = getattr(value, attr, None)
        if isinstance(tid, int):
            return tid
    raise ValueError(f"pad_token_id: {type(value).__name__} has neither pad_token_id nor eos_token_id")


@dataclass
class EngineConfig:
    """The engine's settings; Ludic master's fields and defaults where it has them (except model_device, which
    defaults to "cpu" without CUDA), then ours. What an objective computes (RL's temperature, KL target,
    reference resets, max_lag) is the objective's own config, not here.

    lr: AdamW's learning rate (> 0). pad_token_id: an int or a tokenizer (its pad id, else its eos id); required.
    lr_scheduler: "constant" | "linear" | "cosine" after `warmup_steps` of linear warm-up; the decaying
    schedules need `total_steps`. layout: "padded" (right padding) or "packed" (one row per micro-batch, restarting
    position_ids, attention kept within each sequence by `packed_attention`: "auto" picks flash varlen,
    a flex BlockMask or per-sequence SDPA ("sdpa_varlen", which eager / sdpa models are moved to on CPU),
    see `integrations.packing`; "mask" keeps eager / sdpa with a dense block-diagonal mask; unsupported
    models are refused). check_packing: probe the packed path once
    at construction (two sequences packed vs alone) and refuse it when inexact. body_kernels: Liger-Kernel's
    RMSNorm / RoPE / SwiGLU / GeGLU kernels on the body (`integrations.body_kernels`; None = on for a CUDA
    model_device, True on CPU is refused). compile_body: `torch.compile` each decoder layer (True: inductor,
    or a backend name). mixed_precision_dtype: None (the parameters' dtype throughout) or "bf16" / "fp16":
    the forward runs under torch.autocast in that dtype while parameters, gradients and AdamW states keep
    theirs (fp32 master weights); the head gets the hidden states and its weight cast to it; fp16 adds a
    dynamic loss scale (torch.amp.GradScaler; an overflowing step is skipped and the scale lowered).
    backend / memory_budget / chunk_elements: how the fused head runs (`head_options(cfg)`): memory_budget is the
    bytes (or a string like '4GiB') the LM head may hold beyond its inputs (`ludic_fast.ops.plan`; None: the
    device default); chunk_elements the low-level override of its chunking.
    max_nonfinite_steps: a loss that is not finite this many steps in a row (or rollouts sampling from inf/nan
    probabilities) stops the run with `engine.guard.NonFiniteError` (the model diverged).
    """

    model_device: str = field(default_factory=_default_device)
    runtime_device: str | None = None
    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    max_seq_len: int = 1024
    micro_token_budget: int = 8192
    sync_every_steps: int = 1
    reduce_stats_across_ranks: bool = False
    profile_memory: bool = False
    log_every: int = 1
    pad_token_id: Any = None
    eval_at_start: bool = False
    eval_every_n_steps: int | None = None
    # ours
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    gradient_checkpointing: bool = False
    body_kernels: bool | None = None
    compile_body: bool | str = False
    mixed_precision_dtype: str | None = None
    layout: str = "padded"
    packed_attention: str = "auto"
    check_packing: bool = True
    backend: str = "auto"
    chunk_elements: int | None = None
    memory_budget: int | str | None = None
    max_nonfinite_steps: int = 3

    def __post_init__(self) -> None:
        self.pad_token_id = resolve_pad_token_id(self.pad_token_id)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.micro_token_budget <= 0 or self.micro_token_budget < self.max_seq_len:
            raise ValueError(
                f"micro_token_budget ({self.micro_token_budget}) must be > 0 and >= max_seq_len ({self.max_seq_len})"
            )
        self.memory_budget = parse_memory_budget(self.memory_budget)
        if self.lr_scheduler not in _SCHEDULES:
            raise ValueError(f"lr_scheduler must be one of {_SCHEDULES}, got {self.lr_scheduler!r}")
        if self.lr_scheduler != "constant" and not self.total_steps:
            raise ValueError(f"lr_scheduler={self.lr_scheduler!r} needs total_steps")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.layout not in ("padded", "packed"):
            raise ValueError(f"layout must be 'padded' or 'packed', got {self.layout!r}")
        if self.body_kernels not in (None, True, False):
            raise TypeError(f"body_kernels must be None (auto), True or False, got {self.body_kernels!r}")
        if self.body_kernels:
            check_body_kernels_device(self.model_device)
        if not isinstance(self.compile_body, (bool, str)) or self.compile_body == "":
            raise TypeError(f"compile_body must be a bool or a torch.compile backend name, got {self.compile_body!r}")
        if self.mixed_precision_dtype not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision_dtype must be one of {[k for k in MIXED_PRECISION if k]} or None, "
                f"got {self.mixed_precision_dtype!r}"
            )
        if self.packed_attention not in PACKED_ATTENTION_PATHS:
            raise ValueError(f"packed_attention must be one of {PACKED_ATTENTION_PATHS}, got {self.packed_attention!r}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")




def head_options(cfg: EngineConfig) -> dict[str, Any]:
    """How the fused head runs under `cfg`, as its keyword arguments: backend, chunk_elements, memory_budget."""
    return {"backend": cfg.backend, "chunk_elements": cfg.chunk_elements, "memory_budget": cfg.memory_budget}


def __getattr__(name: str) -> Any:
    if name == "TrainerConfig":  # the engine's settings were named TrainerConfig before the RL ones moved out
        warnings.warn("ludic_fast.engine.config.TrainerConfig is now EngineConfig (the engine's settings alone); "
                      "the RL trainer's config is ludic_fast.trainer.TrainerConfig", DeprecationWarning, stacklevel=2)
        return EngineConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MIXED_PRECISION", "EngineConfig", "head_options", "resolve_pad_token_id"]
