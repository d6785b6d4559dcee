"""Shared helpers: the head op's result type, its input validation and the fp32-head cast.

Both `ludic_fast.reference` and the backends import this module, so a bad argument gets the same
error whichever implementation the caller picked.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_F = TypeVar("_F", bound=Callable)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class HeadOutput(NamedTuple):
    """Per-token results of the LM head; every tensor has the shape of `targets` and dtype float32 (float64 when
    hidden or weight is float64: finite-difference checks).

    logprobs: log p(y_t) at the target (0 where `targets == ignore_index`).
    entropy:  H_t = -sum_v p_v log p_v (0 at ignored positions), or None when not requested.
    lse:      log sum_v exp(z_v), the log-partition of the final logits (no gradient).
    """

    logprobs: Tensor
    entropy: Tensor | None
    lse: Tensor


_TARGET_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def note_target_bounds(targets: Tensor, low: int, high: int) -> None:
    """Record that every value of `targets` lies in [low, high], known on the host (the trainer's collation
    knows its action tokens): `validate_head_inputs` then checks the targets against the vocabulary from these
    bounds, without reading the device, as long as the tensor is not changed in place."""
    if not targets.is_inference():
        _TARGET_BOUNDS[targets] = (targets._version, int(low), int(high))


def _targets_known_in_range(targets: Tensor, upper: int) -> bool:
    """Whether host-noted bounds of `targets` (`note_target_bounds`) put every value in [0, upper)."""
    known = _TARGET_BOUNDS.get(targets)
    return known is not None and known[0] == targets._version and 0 <= known[1] and known[2] < upper


def validate_head_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    logit_scale: float,
    softcap: float | None,
    temperature: float | Tensor,
    ignore_index: int,
    vocab_size: int | None = None,
    vocab_start: int = 0,
) -> None:
    """Raise TypeError/ValueError naming the bad argument of `linear_logprobs`.

    `vocab_size` is the global vocabulary size when `weight` holds only rows
    `[vocab_start, vocab_start + V_local)` (vocab-parallel); targets are checked against it.

    The range of the targets and the values of a temperature tensor are read from the device in one read,
    except where the host knows them: no tensor temperature and targets that are empty or whose bounds were
    noted on the host inside the range (`note_target_bounds`) read nothing. Bounds outside the range take the
    device read, which names the bad targets.
    """
    if not isinstance(hidden, Tensor) or hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be a floating-point tensor, got {getattr(hidden, 'dtype', type(hidden))}")
    if not isinstance(weight, Tensor) or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"weight must be a floating-point tensor, got {getattr(weight, 'dtype', type(weight))}")
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {getattr(targets, 'dtype', type(targets))}")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [V, D], got shape {tuple(weight.shape)}")
    V, D = weight.shape
    if V == 0 or D == 0:
        raise ValueError(f"weight must have V > 0 and D > 0, got shape {tuple(weight.shape)}")
    if hidden.ndim < 1 or hidden.shape[-1] != D:
        raise ValueError(f"hidden must have shape [..., {D}] to match weight [V, D]; got {tuple(hidden.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}"
        )
    if hidden.device != weight.device or targets.device != weight.device:
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}) and targets ({targets.device}) "
            "must be on one device"
        )
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.dtype not in _FLOAT_DTYPES:
            raise TypeError("bias must be a floating-point tensor or None")
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape [{V}], got {tuple(bias.shape)}")
    if not isinstance(logit_scale, (int, float)) or isinstance(logit_scale, bool):
        raise TypeError(f"logit_scale must be a float, got {type(logit_scale).__name__}")
    if not math.isfinite(logit_scale):
        raise ValueError(f"logit_scale must be finite, got {logit_scale}")
    if softcap is not None and (
        not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap must be a finite positive float or None, got {softcap!r}")
    bad_temperature = None
    if isinstance(temperature, Tensor):
        if tuple(temperature.shape) not in ((), tuple(targets.shape)):
            raise ValueError(
                f"temperature tensor must be a scalar or have the shape of targets {tuple(targets.shape)}, "
                f"got {tuple(temperature.shape)}"
            )
        if temperature.dtype == torch.bool or temperature.is_complex():
            raise TypeError(f"temperature tensor must be real, got {temperature.dtype}")
        if temperature.requires_grad:
            raise ValueError("temperature requires grad, but the head gives it no gradient: pass temperature.detach()")
        bad_temperature = ~((temperature > 0) & (temperature < math.inf))  # also NaN
    elif not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    elif not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    upper = vocab_size if vocab_size is not None else V
    if bad_temperature is None and (targets.numel() == 0 or _targets_known_in_range(targets, upper)):
        return
    out_of_range = (targets != ignore_index) & ((targets < 0) | (targets >= upper))
    flags = out_of_range.any().to(torch.uint8)  # bit 0: a target out of range, bit 1: a bad temperature
    if bad_temperature is not None:
        flags = flags + 2 * bad_temperature.any().to(device=flags.device, dtype=torch.uint8)
    flags = int(flags)  # the one host sync of a valid call: both checks read back together
    if flags & 2:
        raise ValueError("temperature must be finite and > 0 everywhere (found a value <= 0, inf or NaN)")
    if flags & 1:
        bad = targets[out_of_range]
        raise ValueError(
            f"targets must lie in [0, {upper}) or equal ignore_index={ignore_index}; "
            f"found {bad.numel()} outside, in [{int(bad.min())}, {int(bad.max())}]"
        )


def head_temperature(value: object, name: str = "temperature") -> float:
    """The head's T in softmax(z / T) as a float: finite and > 0 (TypeError / ValueError naming `name`). The one
    rule for a temperature setting; `logprob_temperature` maps a sampler's to it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return float(value)


def logprob_temperature(sampling: object, name: str = "temperature") -> float:
    """The head temperature of a sampler's log-probs: T for a sampling temperature T > 0; 1 for greedy decoding
    (T = 0, scored with log_softmax(z)). Anything else (negative, inf, NaN, not a number) is refused."""
    if isinstance(sampling, (int, float)) and not isinstance(sampling, bool) and sampling == 0:
        return 1.0
    try:
        return head_temperature(sampling, name)
    except ValueError:
        raise ValueError(f"{name} must be finite and >= 0 (0 = greedy), got {sampling}") from None


def per_token_temperature(temperature: float | Tensor, n_tokens: int, device: torch.device) -> Tensor:
    """Temperature as a flat float64 vector of length `n_tokens` (a scalar is broadcast)."""
    if isinstance(temperature, Tensor):
        flat = temperature.to(device=device, dtype=torch.float64).reshape(-1)
        return flat.expand(n_tokens) if flat.numel() == 1 else flat
    return torch.full((n_tokens,), float(temperature), device=device, dtype=torch.float64)


def to_fp32(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The fp32 LM head (ScaleRL's "FP32 logits"): float32 casts of the head's tensors (hidden, weight, bias or
    logits), differentiable (`.float()`, a no-op on float32), None left as None."""
    return tuple(None if t is None else t.float() for t in tensors)


def autocast_as_matmul(*operands: str) -> Callable[[_F], _F]:
    """Decorate a head entry point whose first argument is the hidden tensor. Inside `torch.autocast` for that
    tensor's device type, the named operands that are float32 are cast (differentiably) to the autocast dtype,
    as autocast casts the inputs of a matmul, and the call runs with autocast off: every backend then computes
    from the same low-precision operands with fp32 statistics, as when called with those operands outside
    autocast. Outside autocast the call is unchanged."""

    def decorate(fn: _F) -> _F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            first = args[0] if args else kwargs.get(operands[0])
            if not isinstance(first, Tensor) or not torch.is_autocast_enabled(first.device.type):
                return fn(*args, **kwargs)
            device_type = first.device.type
            dtype = torch.get_autocast_dtype(device_type)
            bound = signature.bind(*args, **kwargs)
            for name in operands:
                value = bound.arguments.get(name)
                if isinstance(value, Tensor) and value.dtype == torch.float32:
                    bound.arguments[name] = value.to(dtype)
            with torch.autocast(device_type, enabled=False):
                return fn(*bound.args, **bound.kwargs)

        return call  # type: ignore[return-value]

    return decorate
