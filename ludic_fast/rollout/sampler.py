"""The registry of samplers `ludic-fast train --sampler` chooses from, and what a sampler is built from.

("Engine" is the training engine, `ludic_fast.engine`; what generates rollouts is a sampler. The protocol a
sampler implements, `Sampler`, with `SamplingConfig` and `Completion`, is `ludic_fast.rollout.sampling`, re-exported
here.)

Registered samplers: `hf` (transformers `generate` on the trainer's own model), `vllm` (vLLM in this process),
`vllm-server` (vLLM's OpenAI server, started here or reached at a URL). A third party's sampler is one module
with a `SamplerEntry` (or a factory `build(settings) -> Sampler`) named on the command line as `module:attr`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ludic_fast.registry import Registry
from ludic_fast.rollout.sampling import Completion, Sampler, SamplingConfig, cut_at_eos


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
