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
- head transient: the head plan's (`ludic_fast.ops.plan.plan_head`, fused-loss mode, the trainer's backend,
  `memory_budget` / `chunk_elements`) `transient_bytes`: workspace chunks plus the fp32 accumulators (dW [V, D],
  dh [tokens, D]).

It is an estimate: allocator fragmentation, the CUDA context (~0.5 GiB) and framework workspaces are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ludic_fast.integrations.transformers import unwrap_model
from ludic_fast.ops.plan import plan_head

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
    memory_budget: int | str | None = None,
    backend: str = "auto",
    device: torch.device | str | None = None,
) -> MemoryEstimate:
    """The estimate for `model` at `micro_tokens` tokens per micro-batch (module docstring). compute_dtype: the
    activations' and the head's dtype (default: the parameters'). device: where it trains (default: the
    parameters'), for the head plan with `backend`, `memory_budget`, `chunk_elements`. Activations are 0 for a
    model without a transformers config giving hidden_size and num_hidden_layers."""
    if micro_tokens < 1:
        raise ValueError(f"micro_tokens must be >= 1, got {micro_tokens}")
    params = _unique_params(model)
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    lm = unwrap_model(model)
    config = getattr(lm, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = compute_dtype or (params[0].dtype if params else torch.float32)
    act_size = torch.empty((), dtype=dtype).element_size()
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
        where = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
        kind = "triton" if where.type == "cuda" and backend in ("auto", "triton") else "torch"
        plan = plan_head(micro_tokens, dim, vocab, dtype=dtype, mode="fused_loss", device=where, backend=kind,
                         memory_budget=memory_budget, chunk_elements=chunk_elements)
        head_bytes = plan.transient_bytes
    return MemoryEstimate(parameters=param_bytes, gradients=grad_bytes, optimizer=2 * grad_bytes,
                          activations=activations, head=head_bytes)


__all__ = ["MemoryEstimate", "estimate_peak_memory"]
