"""Hidden states and the LM head of any transformers causal LM, without computing logits.

A causal LM of transformers computes `logits = post(lm_head(decoder(input_ids).last_hidden_state))`, where
`post` is the identity for most architectures, a multiplication by a logit scale for some (Cohere's
`logit_scale`, Granite's `1 / logits_scaling`, Falcon-H1's `lm_head_multiplier`, `output_multiplier`) and a
final soft-capping `c * tanh(x / c)` for others (Gemma2/3's `final_logit_softcapping`), in that order.
This module splits such a model into

    hidden = final_hidden_states(model, input_ids, attention_mask)     # [B, T, D], one decoder forward
    head = lm_head(model)                                               # LMHead(weight, bias, logit_scale, softcap)

so that `ludic_fast.linear_logprobs(hidden, targets=..., **head.kwargs())` gives the per-token logprobs and
entropy of `log_softmax(model(input_ids).logits)` without the `[B, T, V]` logits. Nothing here is specific to
one architecture: the decoder is `model.get_decoder()` (or the `base_model_prefix` attribute), the head is
`model.get_output_embeddings()` and the post-processing is read from the (text) config by the names above.
`check_lm_head` compares against the model's own logits once, for architectures with other conventions.

Wrappers handled: DDP/FSDP1-style `.module` wrappers, PEFT `PeftModel` (LoRA on the decoder applies
through its injected layers; LoRA on `lm_head` is merged into the head weight, differentiably;
`modules_to_save` picks the active copy), tied input/output embeddings (the same Parameter), FSDP2 (the
head's DTensor weight is gathered with `full_tensor()`, differentiable) and DeepSpeed ZeRO-3 (`call_head` runs
the fused head as the head module's forward, so ZeRO-3 gathers W for its forward and its backward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast._common import HeadOutput, to_fp32
from ludic_fast.ops import linear_logprobs

#: Config attributes that multiply the head's logits, in the order they are looked up.
_SCALE_ATTRS = ("logit_scale", "output_multiplier", "lm_head_multiplier")
#: Config attributes that divide the head's logits.
_INV_SCALE_ATTRS = ("logits_scaling",)
_SOFTCAP_ATTRS = ("final_logit_softcapping",)


class UnsupportedHeadError(ValueError):
    """The model's output head is not a linear map the fused head can reproduce."""


@dataclass(frozen=True)
class LMHead:
    """The LM head as the fused op sees it: `z = softcap(logit_scale * (h W^T + b))`, `softcap(x) = c tanh(x/c)`.

    weight [V, D] and bias [V] are the model's own tensors (or differentiable views/casts of them), so
    gradients of a loss computed with them reach the model's parameters.
    """

    weight: Tensor
    bias: Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `ludic_fast.linear_logprobs` and the fused losses (`loss(batch, hidden=h, **kw)`)."""
        return {"weight": self.weight, "bias": self.bias, "logit_scale": self.logit_scale, "softcap": self.softcap}

    def logprobs(self, hidden: Tensor, targets: Tensor, **head_kwargs: Any) -> HeadOutput:
        """`ludic_fast.linear_logprobs(hidden, self.weight, targets, bias=..., logit_scale=..., softcap=...)`."""
        kw = self.kwargs()
        weight = kw.pop("weight")
        return linear_logprobs(hidden, weight, targets, **kw, **head_kwargs)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside DDP/FSDP1 (`.module`) and PEFT (`get_base_model()`) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return model


def get_decoder(model: nn.Module) -> nn.Module:
    """The base model (embeddings + blocks + final norm) of a causal LM: `get_decoder()` or `base_model_prefix`."""
    lm = unwrap_model(model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if decoder is None or decoder is lm:
        prefix = getattr(lm, "base_model_prefix", "")
        decoder = getattr(lm, prefix, None) if prefix else None
    if not isinstance(decoder, nn.Module) or decoder is lm:
        raise UnsupportedHeadError(
            f"model: cannot find the base model of {type(lm).__name__} (no get_decoder() and no "
            f"`base_model_prefix` attribute)"
        )
    return decoder


def final_hidden_states(
    model: nn.Module,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    **forward_kwargs: Any,
) -> Tensor:
    """Final hidden states [B, T, D] (after the final norm), from one forward of the base model, no logits.

    Position t of the result scores token t+1 (the causal shift). Extra keyword arguments (position_ids,
    inputs_embeds, ...) go to the base model's forward; `use_cache` is off.
    """
    decoder = get_decoder(model)
    forward_kwargs.setdefault("use_cache", False)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **forward_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if not isinstance(hidden, Tensor) or hidden.ndim != 3:
        raise UnsupportedHeadError(f"model: base model returned no [B, T, D] hidden states ({type(out).__name__})")
    return hidden


def _text_config(lm: nn.Module) -> Any:
    config = getattr(lm, "config", None)
    if config is None:
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_post_processing(lm: nn.Module) -> tuple[float, float | None]:
    """(logit_scale, softcap) of the model's logits, from its text config."""
    config = _text_config(lm)
    scale = 1.0
    for name in _SCALE_ATTRS:
        value = getattr(config, name, None)
        if value is not None:
            scale = float(value)
            break
    else:
        for name in _INV_SCALE_ATTRS:
            value = getattr(config, name, None)
            if value is not None:
                scale = 1.0 / float(value)
                break
    softcap = None
    for name in _SOFTCAP_ATTRS:
        value = getattr(config, name, None)
        if value is not None:
            softcap = float(value)
    return scale, softcap


def _active_adapters(module: nn.Module) -> list[str]:
    if getattr(module, "disable_adapters", False):
        return []
    active = getattr(module, "active_adapters", [])
    return [active] if isinstance(active, str) else list(active)


def _resolve_linear(head: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight [V, D], bias) of the output head, merging a PEFT LoRA and picking a `modules_to_save` copy."""
    if hasattr(head, "modules_to_save") and hasattr(head, "original_module"):  # PEFT ModulesToSaveWrapper
        active = [a for a in _active_adapters(head) if a in head.modules_to_save]
        return _resolve_linear(head.modules_to_save[active[0]] if active else head.original_module)
    if hasattr(head, "lora_A") and hasattr(head, "get_base_layer"):  # PEFT LoRA layer
        return _merge_lora(head)
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or not isinstance(weight, Tensor) or weight.ndim != 2:
        raise UnsupportedHeadError(
            f"model: output head {type(head).__name__} is not a linear layer with a [V, D] weight; "
            "the fused head supports nn.Linear heads (optionally tied, LoRA-wrapped or sharded)"
        )
    return weight, head.bias


def _merge_lora(layer: nn.Module) -> tuple[Tensor, Tensor | None]:
    """W + sum over active adapters of scaling * B A (differentiable in A and B), for a PEFT LoRA Linear."""
    weight, bias = _resolve_linear(layer.get_base_layer())
    if getattr(layer, "merged", False):
        return weight, bias
    for name in _active_adapters(layer):
        if name not in layer.lora_A:
            continue
        if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False):
            raise UnsupportedHeadError(f"model: LoRA variant (e.g. DoRA) on the output head (adapter {name!r})")
        if getattr(layer, "lora_bias", {}).get(name, False):
            raise UnsupportedHeadError(f"model: LoRA bias on the output head (adapter {name!r})")
        dropout = layer.lora_dropout[name]
        if layer.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise UnsupportedHeadError(
                f"model: LoRA dropout p={dropout.p} on the output head (adapter {name!r}) cannot be merged into "
                "the head weight; set lora_dropout=0 for lm_head or keep lm_head out of target_modules"
            )
        delta = layer.get_delta_weight(name)
        weight = weight + delta.to(weight.dtype)
    return weight, bias


def _gather_dtensor(t: Tensor | None) -> Tensor | None:
    """A full tensor from an FSDP2/TP DTensor (differentiable all-gather), anything else unchanged."""
    if t is not None and hasattr(t, "full_tensor") and hasattr(t, "placements"):
        return t.full_tensor()
    return t


def _output_head(lm: nn.Module) -> nn.Module:
    """`lm.get_output_embeddings()`, or `UnsupportedHeadError` when the model has none."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None:
        raise UnsupportedHeadError(f"model: {type(lm).__name__} has no output embeddings (get_output_embeddings())")
    return head


def lm_head(model: nn.Module, *, fp32_head: bool = False) -> LMHead:
    """The `LMHead` of a causal LM: `get_output_embeddings()` weight/bias plus the config's scale and softcap.

    Tied embeddings need nothing special (the head weight is the embedding Parameter, gradients from both
    uses add up). `fp32_head=True` returns float32 casts of weight and bias (differentiable; the hidden
    states are promoted to float32 inside the op) for trainer/sampler logprob agreement. Raises
    `UnsupportedHeadError` (a ValueError) when the head is not a linear layer.
    """
    lm = unwrap_model(model)
    weight, bias = _resolve_linear(_output_head(lm))
    weight, bias = _gather_dtensor(weight), _gather_dtensor(bias)
    if weight.numel() == 0:
        raise UnsupportedHeadError(
            "model: the output head weight is empty (partitioned by ZeRO-3?); use it inside "
            "`call_head(model, fn, hidden)`"
        )
    if fp32_head:
        weight, bias = to_fp32(weight, bias)
    scale, softcap = _head_post_processing(lm)
    return LMHead(weight=weight, bias=bias, logit_scale=scale, softcap=softcap)


def _replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Set `module.forward = forward` (an instance attribute); returns the (idempotent) restore function, which
    brings back the previous instance attribute, if any, e.g. TRL's patched forward."""
    saved = module.__dict__.get("forward")

    def restore() -> None:
        if saved is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = saved

    module.forward = forward
    return restore


def call_head(model: nn.Module, fn: Callable[..., Any], /, *args: Any, fp32_head: bool = False) -> Any:
    """`fn(lm_head(model, fp32_head=fp32_head), *args)`, run as the forward of the model's output-head module.

    Sharding frameworks gather a module's parameters around its forward and again around its backward
    (DeepSpeed ZeRO-3 and a separately `fully_shard`ed FSDP2 head, through module hooks; ZeRO-3 also
    counts parameters of nested modules read in that forward, e.g. PEFT's base_layer and LoRA A/B, as the
    module's own). The fused head reads W directly and needs it whole in backward too: the generic op
    recomputes the logits from W, and every op hands dW [V, D] to the parameter there. Running inside the
    head module's forward gives it both gathers; without sharding this is a plain call. Pass the tensors
    the head consumes (the hidden states) as `args` and return tensors (or tuples/dicts of them): the
    backward hooks attach to those.
    """
    lm = unwrap_model(model)
    head = _output_head(lm)

    def forward(*inputs: Any) -> Any:
        restore()
        return fn(lm_head(lm, fp32_head=fp32_head), *inputs)

    restore = _replace_forward(head, forward)
    try:
        return head(*args)
    finally:
        restore()


def call_in_forward(model: nn.Module, fn: Callable[..., Any], /, **inputs: Any) -> Any:
    """`fn(lm, **inputs)` run in place of the causal LM's forward inside `model(**inputs)`.

    `lm = unwrap_model(model)`. Distributed and adapter wrappers (DDP, FSDP, DeepSpeed engines, PEFT) do
    their work around the inner module's forward: DDP prepares its gradient reduction, FSDP unshards the
    root's parameters, ZeRO-3 arms its backward hooks. A fused head that reads the head weight directly must
    therefore run inside that forward; this temporarily replaces `lm.forward` (an instance attribute, e.g.
    TRL's patched forward, is restored afterwards) and calls `model(**inputs)`. A bare model goes the same
    way: FSDP2's `fully_shard` hooks sit on the model itself. Whatever `fn` returns passes through the
    wrappers unchanged.
    """
    lm = unwrap_model(model)

    def redirected(*_args: Any, **_kwargs: Any) -> Any:
        restore()
        return fn(lm, **inputs)

    restore = _replace_forward(lm, redirected)
    try:
        return model(**inputs)
    finally:
        restore()


@torch.no_grad()
def check_lm_head(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                  atol: float = 1e-4) -> float:
    """Max |log_softmax(model logits) - ours| over all positions and the full vocabulary, on a small input.

    Raises `UnsupportedHeadError` when it exceeds `atol` (an architecture whose head post-processing this
    module does not know). Materialises the logits: call it once, on a few tokens.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    hidden = final_hidden_states(model, input_ids, attention_mask)
    head = lm_head(model)
    raw = hidden.to(head.weight.dtype) @ head.weight.T
    if head.bias is not None:
        raw = raw + head.bias
    z = raw.float() * head.logit_scale
    if head.softcap is not None:
        z = head.softcap * torch.tanh(z / head.softcap)
    err = float((torch.log_softmax(z, -1) - torch.log_softmax(logits, -1)).abs().max())
    if not err <= atol:
        raise UnsupportedHeadError(
            f"model: head reconstruction of {type(unwrap_model(model)).__name__} differs from its logits by "
            f"{err:.3g} (> atol={atol}); its head post-processing is not one ludic_fast knows"
        )
    return err


__all__ = [
    "LMHead",
    "UnsupportedHeadError",
    "unwrap_model",
    "get_decoder",
    "final_hidden_states",
    "lm_head",
    "call_head",
    "call_in_forward",
    "check_lm_head",
]
