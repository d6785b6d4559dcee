"""The rollout side's protocol, `Sampler`, and the registry of samplers `ludic-fast train --sampler` chooses from.

("Engine" is the training engine, `ludic_fast.engine`; what generates rollouts is a sampler.)

A sampler does three things:
- `generate(prompts, sampling, *, seed=None) -> list[Completion]`: completions of token-id prompts under a
  `SamplingConfig`, each with the behaviour log-prob of every sampled token, `log_softmax(z / T)[y]` over the
  full vocabulary, z the model's raw logits (T = the sampling temperature; T = 0 is greedy decoding, with the
  log-probs of `log_softmax(z)`), which is what `loss(batch, hidden=h, weight=W, temperature=T)` computes for
  the same token;
- `publish(params, version)`: take the trainer's new weights (a name -> tensor mapping in the trainer's names);
- `version`: the policy version of the weights it samples with now, stamped on each rollout as `policy_version`.

Registered samplers: `hf` (transformers `generate` on the trainer's own model), `vllm` (vLLM in this process),
`vllm-server` (vLLM's OpenAI server, started here or reached at a URL). A third party's sampler is one module
with a `SamplerEntry` (or a factory `build(settings) -> Sampler`) named on the command line as `module:attr`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from ludic_fast._common import logprob_temperature
from ludic_fast.registry import Registry


@dataclass(frozen=True)
class SamplingConfig:
    """temperature (0 = greedy), top_p, top_k (0 = off), max_new_tokens per completion."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        logprob_temperature(self.temperature)  # finite and >= 0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def logprob_temperature(self) -> float:
        """The head temperature of this sampler's log-probs (`ludic_fast._common.logprob_temperature`)."""
        return logprob_temperature(self.temperature)


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (ending in eos when stopped), their behaviour logprobs, and
    finish_reason "stop" (eos produced) or "length" (max_new_tokens reached)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def cut_at_eos(ids: list[int], logprobs: list[float], eos_ids: set[int]) -> tuple[list[int], list[float], str]:
    """Keep tokens up to and including the first eos; finish reason "stop" if one was found, else "length"."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1], logprobs[: i + 1], "stop"
    return ids, logprobs, "length"


@runtime_checkable
class Sampler(Protocol):
    """What a rollout source and the trainer's weight push need of the rollout side (module docstring)."""

    version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
                 ) -> list[Completion]: ...

    def publish(self, params: Mapping[str, Tensor], version: int) -> None: ...


@dataclass
class SamplerSettings:
    """What a sampler is built from.

    model: the trainer's model (an in-process sampler shares it); model_path(): a directory or Hub name of the
    model for a sampler that loads its own copy (called only by those); dtype: torch's name of the serving
    precision ("float32", "bfloat16", "float16"); options: the sampler's own arguments (`--vllm-arg KEY=VALUE`);
    url: a running server to use instead of starting one.
    """

    model: nn.Module
    tokenizer: Any
    seed: int = 0
    dtype: str = "float32"
    model_path: Callable[[], str] | None = None
    tokenizer_path: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    url: str | None = None

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id


@dataclass(frozen=True)
class SamplerEntry:
    """A sampler in the registry: `build(settings) -> Sampler`; `flags`: the command-line flags (argparse dest
    names) it reads beyond `--sampler`; `package`: the optional package it imports (with the pip extra), not
    needed when the flag `package_unless` is given (a server reached by URL)."""

    name: str
    help: str
    build: Callable[[SamplerSettings], Sampler]
    flags: tuple[str, ...] = ()
    package: tuple[str, str] | None = None
    package_unless: str | None = None


def _factory_entry(obj: Any, spec: str) -> SamplerEntry:
    """A `module:attr` spec: a SamplerEntry, or a factory `build(settings) -> Sampler`."""
    if isinstance(obj, SamplerEntry):
        return obj
    if not callable(obj):
        raise TypeError(f"sampler {spec!r}: expected a SamplerEntry or a factory build(settings) -> Sampler, "
                        f"got {type(obj).__name__}")
    return SamplerEntry(spec, f"{spec} (user factory)", obj)


def _hf(settings: SamplerSettings) -> Sampler:
    from ludic_fast.rollout.hf_sampler import HFSampler

    tok = settings.tokenizer
    return HFSampler(settings.model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _tokenizer_option(settings: SamplerSettings) -> dict[str, Any]:
    return {"tokenizer": settings.tokenizer_path} if settings.tokenizer_path else {}


def _vllm(settings: SamplerSettings) -> Sampler:
    from ludic_fast.rollout.vllm_sampler import VLLMSampler

    kwargs = {"dtype": settings.dtype, **_tokenizer_option(settings), **settings.options}
    return VLLMSampler(_path(settings), eos_token_id=settings.eos_token_id, seed=settings.seed, **kwargs)


def _vllm_server(settings: SamplerSettings) -> Sampler:
    from ludic_fast.rollout.vllm_server import server_sampler

    engine_args = None if settings.url else {  # a server given by URL runs with its own
        "dtype": settings.dtype, **_tokenizer_option(settings), **settings.options}
    return server_sampler(_path(settings), url=settings.url, eos_token_id=settings.eos_token_id, seed=settings.seed,
                         engine_args=engine_args)


def _path(settings: SamplerSettings) -> str:
    if settings.model_path is None:
        raise ValueError("this sampler loads its own copy of the model: SamplerSettings.model_path is required")
    return settings.model_path()


_VLLM = ("vllm", "pip install 'ludic-fast[vllm]'")

#: the samplers by name (`--sampler NAME`, or `module:attr` for a third party's)
SAMPLERS: Registry[SamplerEntry] = Registry("sampler", coerce=_factory_entry)
SAMPLERS.add(SamplerEntry("hf", "transformers generate on the trainer's model (CPU or GPU)", _hf))
SAMPLERS.add(SamplerEntry("vllm", "vLLM in this process, weights pushed in place ([vllm] extra)", _vllm,
                          flags=("vllm_arg",), package=_VLLM))
SAMPLERS.add(SamplerEntry("vllm-server", "vLLM's OpenAI server, started here or at --vllm-url ([vllm] extra)",
                          _vllm_server, flags=("vllm_arg", "vllm_url"), package=_VLLM, package_unless="vllm_url"))


__all__ = ["SamplingConfig", "Completion", "cut_at_eos", "Sampler", "SamplerSettings", "SamplerEntry", "SAMPLERS"]
