"""Fused kernels for the model body (the decoder), and `torch.compile` of its layers.

The head is ours (`ludic_fast.linear_logprobs` and the fused losses); the rest of a step is the body: norms,
rotary embeddings, MLPs and attention. Liger-Kernel (github.com/linkedin/Liger-Kernel) ships Triton kernels
for RMSNorm, RoPE, SwiGLU / GeGLU MLPs and LayerNorm with one `apply_liger_kernel_to_<arch>(..., model=m)`
function per architecture, keyed by the config's `model_type` (`MODEL_TYPE_TO_APPLY_LIGER_FN`). This module
calls that function on the model instance with Liger's own per-architecture defaults for the body kernels and
**always** `cross_entropy=False, fused_linear_cross_entropy=False`: Liger's head patches would replace the
causal LM's forward and loss, which the trainer never calls for logits.

Liger patches the instance's modules (their `forward`) and also rebinds module-level names of
`transformers.models.<arch>.modeling_<arch>`: classes (`LlamaRMSNorm`, `LlamaMLP`) and functions
(`apply_rotary_pos_emb`). Left as they are, every model of the architecture built later in the process, on any
device, would get Triton modules — a CPU model then fails. So after the call the classes are put back (the
instance's modules are already patched) and each replaced function becomes a dispatcher: Liger's on CUDA
tensors, transformers' original elsewhere. The kernels need a GPU (CUDA).
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ludic_fast.integrations.transformers import get_decoder, unwrap_model

#: Liger flags that patch the head or the loss; the trainer's head is ours, so they are always False.
HEAD_FLAGS = ("cross_entropy", "fused_linear_cross_entropy")


@dataclass(frozen=True)
class BodyKernelPlan:
    """The Liger apply function for one model type and the keyword arguments it is called with."""

    model_type: str
    apply_fn: Callable[..., None]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def kernels(self) -> list[str]:
        """Names of the body kernels switched on (flags that are True)."""
        return sorted(k for k, v in self.kwargs.items() if v is True)


def model_type_of(model: nn.Module) -> str | None:
    """`config.model_type` of the unwrapped model (None without a transformers config)."""
    config = getattr(unwrap_model(model), "config", None)
    value = getattr(config, "model_type", None)
    return value if isinstance(value, str) and value else None


def _liger_registry() -> dict[str, Callable[..., None]]:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise ImportError(
            "body_kernels needs Liger-Kernel: pip install 'ludic-fast[liger]' (or liger-kernel)"
        ) from exc
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def body_kernel_plan(model_type: str | None, registry: dict[str, Callable[..., None]] | None = None
                     ) -> BodyKernelPlan | None:
    """The Liger function for `model_type` with its own defaults for every body flag and the head flags False;
    None where Liger has no patch for the type. Flags the function does not take are left out (its `**kwargs`
    functions, which dispatch to sub-models, get the head flags)."""
    registry = _liger_registry() if registry is None else registry
    fn = registry.get(model_type) if model_type else None
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {
        name: p.default
        for name, p in params.items()
        if name not in (*HEAD_FLAGS, "model") and isinstance(p.default, bool)
    }
    for flag in HEAD_FLAGS:
        if flag in params or takes_any:
            kwargs[flag] = False
    return BodyKernelPlan(model_type=model_type, apply_fn=fn, kwargs=kwargs)


def check_body_kernels_device(device: torch.device | str) -> None:
    """ValueError unless `device` is CUDA: Liger's kernels are Triton GPU kernels."""
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"body_kernels=True needs a CUDA model_device (got {str(device)!r}): Liger-Kernel's RMSNorm / RoPE / "
            "SwiGLU / GeGLU are Triton GPU kernels; leave body_kernels unset (auto: on for CUDA only) on CPU"
        )


def apply_body_kernels(model: nn.Module) -> BodyKernelPlan | None:
    """Patch the model's body with Liger's kernels (module docstring; run it on a CUDA model, see
    `check_body_kernels_device`). Returns the plan applied, or None after one warning where Liger has no
    patch for the model type (the model is left unchanged)."""
    lm = unwrap_model(model)
    model_type = model_type_of(lm)
    plan = body_kernel_plan(model_type)
    if plan is None:
        warnings.warn(
            f"body_kernels: Liger-Kernel has no patch for model type {model_type!r} ({type(lm).__name__}); "
            "the body runs transformers' own modules",
            stacklevel=2,
        )
        return None
    modules = {sys.modules[type(m).__module__] for m in (lm, get_decoder(lm))}
    before = {module: dict(vars(module)) for module in modules}
    plan.apply_fn(model=lm, **plan.kwargs)
    for module, names in before.items():
        _scope_module_patches(module, names)
    return plan


def _scope_module_patches(module: Any, before: dict[str, Any]) -> None:
    """Undo Liger's rebinding of `module`'s classes; turn its replaced functions into CUDA-only dispatchers."""
    for name, value in list(vars(module).items()):
        old = before.get(name, value)
        if old is value:
            continue
        original = getattr(old, "__ludic_original__", old)
        if isinstance(original, type):
            setattr(module, name, original)
        elif callable(original) and callable(value):
            setattr(module, name, _cuda_dispatch(value, original))


def _cuda_dispatch(fused: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """`fused(*args)` when the first tensor argument is on CUDA, else `original(*args)`."""
    fused = getattr(fused, "__ludic_fused__", fused)

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        return (fused if first is not None and first.is_cuda else original)(*args, **kwargs)

    dispatch.__ludic_original__ = original
    dispatch.__ludic_fused__ = fused
    return dispatch


def compile_body(model: nn.Module, backend: str = "inductor") -> int:
    """`torch.compile` each decoder layer in place (`nn.Module.compile`; parameters and names unchanged, so
    optimizers, checkpoints and FSDP see the same module tree); the whole decoder where it has no `layers`
    list. Returns the number of modules compiled."""
    decoder = get_decoder(model)
    layers = getattr(decoder, "layers", None)
    targets = list(layers) if isinstance(layers, nn.ModuleList) and len(layers) else [decoder]
    for module in targets:
        module.compile(backend=backend)
    return len(targets)


__all__ = [
    "HEAD_FLAGS",
    "BodyKernelPlan",
    "model_type_of",
    "body_kernel_plan",
    "check_body_kernels_device",
    "apply_body_kernels",
    "compile_body",
]
