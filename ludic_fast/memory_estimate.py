"""A peak-memory estimate of one training step, printed before the first step.

    total = parameters + gradients + AdamW states + activations + head transient

- parameters: Σ numel · element size over the model's (deduplicated, so tied) parameters;
- gradients: the same over trainable parameters; AdamW: two states (exp_avg, exp_avg_sq) per trainable
  element in its dtype;
- activations, per token of a micro-batch (`micro_tokens` = the trainer's micro_token_budget) and decoder
  layer, in the compute dtype: `10·h + 4·I` elements (h = hidden size, I = MLP intermediate size): the
  attention block keeps its norm input/output, q, k, v, the attention output and o_proj's input (≈ 6h with
  k, v counted at full width), the gated MLP its input, gate, up, activation and product (≈ h + 4I), the two
  norms ≈ 2h more — the accounting of Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv 2205.05198), with a memory-efficient attention (no [T, T] scores kept). Under
  gradient checkpointing each layer keeps only its input h, plus one layer's full set during its recompute;
- head transient: the fused head's chunk buffers (fp32 logits and d(raw): 8 bytes per chunk element), the
  fp32 dW accumulator [V, D] when the head weight trains, and the fp32 d(hidden) [tokens, D].

It is an estimate: allocator fragmentation, the CUDA context (~0.5 GiB) and framework workspaces are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ludic_fast.integrations.transformers import unwrap_model
from ludic_fast.ops.plan import DEFAULT_CHUNK_ELEMENTS

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per term (module docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    head: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.head

    def format(self) -> str:
        """One line: the total and each term in GiB."""
        terms = (("parameters", self.parameters), ("gradients", self.gradients), ("AdamW", self.optimizer),
                 ("activations", self.activations), ("head", self.head))
        parts = " + ".join(f"{name} {value / GiB:.2f}" for name, value in terms)
        return f"peak memory estimate {self.total / GiB:.2f} GiB = {parts} (GiB)"


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def estimate_peak_memory(
    model: nn.Module,
    *,
    micro_tokens: int,
    compute_dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    chunk_elements: int | None = None,
) -> MemoryEstimate:
    """The estimate for `model` at `micro_tokens` tokens per micro-batch (module docstring). compute_dtype: the
    activations' dtype (default: the parameters'). Activations are 0 for a model without a transformers config
    giving hidden_size and num_hidden_layers."""
    if micro_tokens < 1:
        raise ValueError(f"micro_tokens must be >= 1, got {micro_tokens}")
    params = _unique_params(model)
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    lm = unwrap_model(model)
    config = getattr(lm, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    act_size = torch.empty((), dtype=compute_dtype or (params[0].dtype if params else torch.float32)).element_size()
    h = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    activations = 0
    if isinstance(h, int) and isinstance(layers, int):
        inter = getattr(config, "intermediate_size", None) or 4 * h
        per_layer = 10 * h + 4 * inter
        kept = layers * h + per_layer if gradient_checkpointing else layers * per_layer
        activations = micro_tokens * (kept + 2 * h) * act_size  # + embeddings output and final norm
    head_bytes = 0
    out = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.ndim == 2:
        vocab, dim = weight.shape
        chunk = chunk_elements or DEFAULT_CHUNK_ELEMENTS
        head_bytes = 8 * min(chunk, micro_tokens * vocab) + 4 * micro_tokens * dim
        if weight.requires_grad:
            head_bytes += 4 * vocab * dim
    return MemoryEstimate(parameters=param_bytes, gradients=grad_bytes, optimizer=2 * grad_bytes,
                          activations=activations, head=head_bytes)


__all__ = ["MemoryEstimate", "estimate_peak_memory"]
