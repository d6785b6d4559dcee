"""The model recipe of `ludic-fast train`: size profiles, precision, attention, head backend, body kernels.

`--profile tiny` keeps the embedded toy's defaults (a 0.1M-parameter model from scratch learns at lr 1e-3 in
seconds); `--profile real` is for a pretrained Hugging Face model (lr 1e-6 for RL and 1e-5 for the SFT
warm-up, completions of up to 512 tokens). `auto` picks tiny for `--model embedded`, real otherwise. A flag
given on the command line always wins over the profile.

`--dtype`: the compute precision. bf16 / fp16 run the forward under autocast with fp32 master weights,
gradients and AdamW states (`TrainerConfig.mixed_precision_dtype`; fp16 with a dynamic loss scale), so an
update of lr 1e-6 is not lost to bf16 rounding (a bf16 weight of 0.02 moves only in steps of about 1e-4).
auto: bf16 on CUDA, fp32 elsewhere.

`--attn`: the attention implementation the model is built with. auto: flash_attention_2 on CUDA when
flash-attn is installed, else sdpa. With `--layout packed` the trainer keeps packed sequences apart on each
of them (`integrations.packing`); on CUDA it moves an eager / sdpa model to flash_attention_2 (when installed
and the compute is bf16/fp16) or else flex_attention, whose kernels skip the masked blocks.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

import torch

from ludic_fast.cli.validation import UsageError, require_package

#: per-profile defaults of the flags whose sensible value depends on the model's size
PROFILES: dict[str, dict[str, Any]] = {
    "tiny": {"sft_lr": 3e-3, "lr": 1e-3, "max_new_tokens": 3, "max_seq_len": 64, "micro_token_budget": 4096},
    "real": {"sft_lr": 1e-5, "lr": 1e-6, "max_new_tokens": 512, "max_seq_len": 1024, "micro_token_budget": 16384},
}
DTYPES = ("auto", "bf16", "fp16", "fp32")
ATTENTION = ("auto", "eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
#: --attn values that need a package: (module, how to install it)
_ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "pip install 'ludic-fast[flash-attn]'"),
    "flash_attention_3": ("flash_attn_interface",
                          "pip install FlashAttention-3 (the hopper/ build of Dao-AILab/flash-attention)"),
}


def profile_default_help(flag: str) -> str:
    """'default: <tiny> (tiny profile) / <real> (real profile)' for a profile-dependent flag (its dest name)."""
    return f"default: {PROFILES['tiny'][flag]:g} (tiny profile) / {PROFILES['real'][flag]:g} (real profile)"


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe flags (module docstring) as one argument group."""
    g = parser.add_argument_group("model recipe (precision, attention, kernels)")
    g.add_argument("--profile", default="auto", choices=["auto", *PROFILES],
                   help="flag defaults by model size: tiny (the embedded toy) or real (a pretrained HF model); "
                        "auto: tiny for --model embedded, else real")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute precision; bf16/fp16 keep fp32 master weights (default auto: bf16 on CUDA, "
                        "fp32 on CPU)")
    g.add_argument("--attn", default="auto", choices=ATTENTION,
                   help="attention implementation (default auto: flash_attention_2 on CUDA with flash-attn "
                        "installed, else sdpa)")
    g.add_argument("--layout", default="padded", choices=["padded", "packed"],
                   help="micro-batch layout; packed: no padding, sequences kept apart on every --attn "
                        "(on CUDA eager/sdpa move to flash_attention_2 or flex_attention)")
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="fused head backend (auto: triton on CUDA, torch on CPU)")
    g.add_argument("--body-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="Liger-Kernel RMSNorm/RoPE/SwiGLU/GeGLU on the model body (default: on for CUDA)")
    g.add_argument("--compile-body", action="store_true", help="torch.compile each decoder layer")


def resolve_profile(args: argparse.Namespace) -> str:
    return args.profile if args.profile != "auto" else ("tiny" if args.model == "embedded" else "real")


def resolve_dtype(name: str, device: str) -> str:
    """bf16 | fp16 | fp32; auto is bf16 on CUDA and fp32 elsewhere."""
    if name != "auto":
        return name
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def resolve_attention(name: str, device: str) -> str:
    """The attention implementation; auto is flash_attention_2 on CUDA with flash-attn installed, else sdpa."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def apply_recipe(args: argparse.Namespace) -> None:
    """Fill the profile's defaults into flags left unset (None) and resolve --dtype / --attn in place; a
    combination that cannot run is a `UsageError` naming the flags."""
    args.profile = resolve_profile(args)
    for name, value in PROFILES[args.profile].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    cuda = torch.device(args.device).type == "cuda"
    if args.body_kernels and not cuda:
        raise UsageError(f"--body-kernels needs --device cuda (Liger-Kernel's are GPU kernels), got {args.device}")
    if args.backend == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(f"--backend triton needs --device cuda (or TRITON_INTERPRET=1, the Triton interpreter), "
                         f"got {args.device}")
    args.dtype = resolve_dtype(args.dtype, args.device)
    args.attn = resolve_attention(args.attn, args.device)
    if args.attn.startswith("flash_attention") and (not cuda or args.dtype == "fp32"):
        raise UsageError(f"--attn {args.attn} needs --device cuda and --dtype bf16 or fp16")
    if args.attn in _ATTENTION_PACKAGES:
        require_package(*_ATTENTION_PACKAGES[args.attn], f"--attn {args.attn}")
    if args.attn == "flex_attention" and not cuda:
        raise UsageError("--attn flex_attention needs --device cuda (PyTorch's flex attention has no CPU backward)")


def mixed_precision(args: argparse.Namespace) -> str | None:
    """TrainerConfig.mixed_precision_dtype for the resolved --dtype."""
    return None if args.dtype == "fp32" else args.dtype


def recipe_trainer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """TrainerConfig keyword arguments of the recipe flags."""
    return {
        "mixed_precision_dtype": mixed_precision(args),
        "layout": args.layout,
        "backend": args.backend,
        "body_kernels": args.body_kernels,
        "compile_body": args.compile_body,
    }


__all__ = [
    "PROFILES",
    "DTYPES",
    "ATTENTION",
    "profile_default_help",
    "add_recipe_arguments",
    "resolve_profile",
    "resolve_dtype",
    "resolve_attention",
    "apply_recipe",
    "mixed_precision",
    "recipe_trainer_kwargs",
]
