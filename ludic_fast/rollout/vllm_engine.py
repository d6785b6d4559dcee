"""Rollout engine on vLLM (GPU, in-process), weights synced from the trainer after each step.

vllm is imported lazily (only when an engine is built). Behaviour logprobs follow the losses'
temperature semantics: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. the log-softmax of
the logits after temperature scaling, `log_softmax(z / T)` (keep top-k / top-p off for exact on-policy
ratios, as with the transformers engine).

Weight sync: trainer parameter names (plain, DDP, PEFT) are mapped to vLLM's names by `vllm_weight_name`
(Ludic's rules: drop LoRA tensors — the trainer merges adapters before publishing —, strip
`base_model.model.` prefixes, drop `.base_layer`, `model.model.` -> `model.`, `layers.` -> `model.layers.`)
and loaded with the model's own `load_weights`, which fuses q/k/v and gate/up itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ludic_fast.rollout.engine import Completion, SamplingConfig, cut_at_eos


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


class VLLMEngine:
    """`vllm.LLM` in this process; `generate(prompts, sampling, seed)` -> `Completion`s, `publish(params, version)`."""

    def __init__(
        self,
        model: str,
        *,
        eos_token_id: int | list[int],
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        **llm_kwargs: Any,
    ):
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights reachable
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("VLLMEngine needs vllm: pip install 'ludic-fast[vllm]'") from exc

        self.llm = LLM(
            model=model,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.eos_ids = {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}
        self.version = 0

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, *, seed: int | None = None
    ) -> list[Completion]:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or -1,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=sorted(self.eos_ids),
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        result = []
        for prompt, out in zip(prompts, outputs):
            choice = out.outputs[0]
            ids = list(choice.token_ids)
            logps = [float(step[t].logprob) for t, step in zip(ids, choice.logprobs)]
            ids, logps, reason = cut_at_eos(ids, logps, self.eos_ids)
            if choice.finish_reason == "length":
                reason = "length"
            result.append(Completion(list(prompt), ids, logps, reason))
        return result

    def publish(self, params: Mapping[str, Tensor], version: int) -> None:
        weights = list(map_weights_for_vllm(params).items())

        def load(model: Any) -> None:
            model.load_weights(weights)

        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(load)
        else:  # older vLLM: the driver worker's model
            load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
        self.llm.reset_prefix_cache()
        self.version = int(version)


__all__ = ["VLLMEngine", "vllm_weight_name", "map_weights_for_vllm"]
