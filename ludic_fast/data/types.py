"""Data contracts of the trainer stack, with Ludic master's names and fields.

Rollout side: `TokenTrace` (token ids and behaviour logprobs of one model call), `Step`, `Rollout`
(`total_reward = Σ_t step.reward`), and the request that produces rollouts, `RolloutRequest` with
`EnvSpec`, `ProtocolSpec`, `InferenceSpec`.

Training side: `SAWItem` (State-Action-Weight: one tokenised sample with its masks and scalar weight,
i.e. its advantage), `SampleAttachments`/`ActorTokenLogps` (behaviour logprobs of the action tokens, in
position order) and `SAWBatch`.

Every type validates on construction (TypeError/ValueError naming the field) and round-trips through
plain JSON-compatible dicts with `to_dict()` / `from_dict()` (one generic pair, `ludic_fast.data.dict_codec`:
a nested type is a nested dict under its field's name), so items can travel as JSON or msgpack.
Free-form fields (`meta`, `info`, observations, actions) must themselves be JSON-compatible to travel.
"""

from __future__ import annotations

import math
import numbers
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ludic_fast.data.dict_codec import DictCodec

RolloutStepKey = tuple[str, int]
"""(rollout.id, step.index): the key of a credit map."""


def _int_list(value: Any, name: str) -> list[int]:
    """A list of Python ints (numpy/other Integral scalars accepted); bools and floats are rejected."""
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in value
    ):
        raise TypeError(f"{name} must be a List[int]")
    return [int(v) for v in value]


def _float_list(value: Any, name: str) -> list[float]:
    """A list of Python floats (any Real scalar accepted); bools and non-numbers are rejected."""
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, numbers.Real) for v in value
    ):
        raise TypeError(f"{name} must be a List[float]")
    return [float(v) for v in value]


def _finite_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _dict(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    return dict(value)


# ------------------------------------------------------------------------------------------ rollouts
@dataclass
class TokenTrace(DictCodec):
    """Token ids of one model call and, optionally, the behaviour logprob of each completion token."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float] | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = _int_list(self.prompt_token_ids, "prompt_token_ids")
        self.completion_token_ids = _int_list(self.completion_token_ids, "completion_token_ids")
        if self.completion_logprobs is not None:
            self.completion_logprobs = _float_list(self.completion_logprobs, "completion_logprobs")
            if len(self.completion_logprobs) != len(self.completion_token_ids):
                raise ValueError(
                    f"completion_logprobs has {len(self.completion_logprobs)} entries but there are "
                    f"{len(self.completion_token_ids)} completion_token_ids"
                )
        if self.finish_reason is not None and not isinstance(self.finish_reason, str):
            raise TypeError("finish_reason must be a str or None")



@dataclass
class Step(DictCodec):
    """One environment step of a rollout; `reward` must be finite."""

    index: int
    prev_obs: Any
    action: Any
    next_obs: Any
    reward: float
    truncated: bool = False
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    trace: TokenTrace | None = None
    ts_ns: int = field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"index must be a non-negative int, got {self.index!r}")
        self.reward = _finite_float(self.reward, f"reward of step {self.index}")
        self.info = _dict(self.info, "info")
        if self.trace is not None and not isinstance(self.trace, TokenTrace):
            raise TypeError(f"trace must be a TokenTrace or None, got {type(self.trace).__name__}")



@dataclass
class Rollout(DictCodec):
    """A sequence of steps with an id (uuid4 by default) and free-form `meta`."""

    steps: list[Step] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def __post_init__(self) -> None:
        if not isinstance(self.steps, (list, tuple)) or any(not isinstance(s, Step) for s in self.steps):
            raise TypeError("steps must be a List[Step]")
        self.steps = list(self.steps)
        self.meta = _dict(self.meta, "meta")
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"id must be a non-empty str, got {self.id!r}")

    @property
    def total_reward(self) -> float:
        """Σ_t step.reward (plain Python sum, as Ludic)."""
        return sum(s.reward for s in self.steps)



# -------------------------------------------------------------------------------------------- requests
@dataclass
class _KindSpec(DictCodec):
    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"{name}.kind must be a non-empty str, got {self.kind!r}")
        self.kwargs = _dict(self.kwargs, f"{name}.kwargs")



@dataclass
class EnvSpec(_KindSpec):
    """Which environment to build (`kind` in the env registry) and its constructor kwargs."""


@dataclass
class ProtocolSpec(_KindSpec):
    """Which interaction protocol to build (`kind` in the protocol registry) and its kwargs."""


@dataclass
class InferenceSpec(DictCodec):
    """Sampling parameters of a rollout request (Ludic's SamplingParams defaults) and what to return."""

    temperature: float = 0.7
    max_tokens: int = 256
    top_p: float = 1.0
    stop: list[str] | None = None
    return_token_ids: bool = True
    return_chosen_logprobs: bool = True

    def __post_init__(self) -> None:
        if _finite_float(self.temperature, "temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not 0.0 < _finite_float(self.top_p, "top_p") <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")



@dataclass
class RolloutRequest(DictCodec):
    """One request for `num_episodes` episodes of `env` under `protocol`; `meta` is copied onto rollouts."""

    env: EnvSpec
    protocol: ProtocolSpec
    env_seed: int | None = None
    sampling_seed: int | None = None
    inference: InferenceSpec | None = None
    num_episodes: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.env, EnvSpec):
            raise TypeError(f"env must be an EnvSpec, got {type(self.env).__name__}")
        if not isinstance(self.protocol, ProtocolSpec):
            raise TypeError(f"protocol must be a ProtocolSpec, got {type(self.protocol).__name__}")
        for name in ("env_seed", "sampling_seed"):
            seed = getattr(self, name)
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise TypeError(f"{name} must be an int or None, got {seed!r}")
        if self.inference is not None and not isinstance(self.inference, InferenceSpec):
            raise TypeError(f"inference must be an InferenceSpec or None, got {type(self.inference).__name__}")
        if isinstance(self.num_episodes, bool) or not isinstance(self.num_episodes, int) or self.num_episodes < 1:
            raise ValueError(f"num_episodes must be a positive int, got {self.num_episodes!r}")
        self.meta = _dict(self.meta, "meta")



# -------------------------------------------------------------------------------------- training items
@dataclass(frozen=True)
class ActorTokenLogps(DictCodec):
    """Behaviour log-probs of an item's action tokens, 1:1 with `action_mask == 1` positions, in order."""

    token_logps: list[float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_logps", _float_list(self.token_logps, "ActorTokenLogps.token_logps"))


@dataclass
class SampleAttachments(DictCodec):
    """Optional per-sample payloads that travel with a SAWItem."""

    actor_logps: ActorTokenLogps | None = None

    def __post_init__(self) -> None:
        if self.actor_logps is not None and not isinstance(self.actor_logps, ActorTokenLogps):
            raise TypeError(f"actor_logps must be an ActorTokenLogps or None, got {type(self.actor_logps).__name__}")


@dataclass
class SAWItem(DictCodec):
    """One training sample: token ids, masks (same length), a finite scalar weight (the advantage), meta.

    `actor_logps` length is checked later (`validate_actor_logps`, collation), as in Ludic, so an item can
    carry logps for tokens that truncation will drop.
    """

    input_ids: list[int]
    attention_mask: list[int]
    action_mask: list[int]
    weight: float
    meta: dict[str, Any] = field(default_factory=dict)
    attachments: SampleAttachments = field(default_factory=SampleAttachments)

    def __post_init__(self) -> None:
        self.input_ids = _int_list(self.input_ids, "input_ids")
        self.attention_mask = _int_list(self.attention_mask, "attention_mask")
        self.action_mask = _int_list(self.action_mask, "action_mask")
        if not self.input_ids:
            raise ValueError("input_ids must not be empty")
        for name in ("attention_mask", "action_mask"):
            mask = getattr(self, name)
            if len(mask) != len(self.input_ids):
                raise ValueError(f"{name} has length {len(mask)} but input_ids has length {len(self.input_ids)}")
            if any(v not in (0, 1) for v in mask):
                raise ValueError(f"{name} must contain only 0 and 1")
        self.weight = _finite_float(self.weight, "weight")
        self.meta = _dict(self.meta, "meta")
        if not isinstance(self.attachments, SampleAttachments):
            raise TypeError(f"attachments must be SampleAttachments, got {type(self.attachments).__name__}")

    @property
    def actor_logps(self) -> ActorTokenLogps | None:
        return self.attachments.actor_logps

    def __len__(self) -> int:
        return len(self.input_ids)



@dataclass
class SAWBatch(DictCodec):
    """A macro-batch of items plus batch-level meta (counts, averages, filter fractions)."""

    items: list[SAWItem] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.items, (list, tuple)) or any(not isinstance(i, SAWItem) for i in self.items):
            raise TypeError("items must be a List[SAWItem]")
        self.items = list(self.items)
        self.meta = _dict(self.meta, "meta")



SampleFilter = Callable[[SAWItem], bool]
"""True means KEEP."""

Preprocess = Callable[[SAWBatch], SAWBatch]


class CreditAssigner(Protocol):
    """Maps every step of every rollout to a scalar weight."""

    def compute(self, rollouts: Sequence[Rollout]) -> dict[RolloutStepKey, float]: ...


def group_id_of(meta: Mapping[str, Any]) -> str | None:
    """The GRPO group of a rollout/item: `meta['request_meta']['group_id']`, else `meta['group_id']`, else None.

    Ludic reads only the first place; the engine copies request meta to both, so the fallback only helps
    rollouts built by hand.
    """
    request_meta = meta.get("request_meta")
    if isinstance(request_meta, Mapping) and request_meta.get("group_id") is not None:
        return str(request_meta["group_id"])
    gid = meta.get("group_id")
    return None if gid is None else str(gid)


__all__ = [
    "RolloutStepKey",
    "TokenTrace",
    "Step",
    "Rollout",
    "EnvSpec",
    "ProtocolSpec",
    "InferenceSpec",
    "RolloutRequest",
    "ActorTokenLogps",
    "SampleAttachments",
    "SAWItem",
    "SAWBatch",
    "SampleFilter",
    "Preprocess",
    "CreditAssigner",
    "group_id_of",
]
