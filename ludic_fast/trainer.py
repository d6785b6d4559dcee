"""The bundled trainer: Ludic's `Trainer` shape (https://github.com/joanvelja/ludic) on the fused head.

One `train_step()`:
1. fetch a SAWBatch from the batch source (async), drop items older than `max_lag` policy versions,
   run `algo.preprocess`; refetch while nothing is left;
2. split the N items by token budget (Ludic's truncate -> sort -> pack) and collate each chunk;
3. per chunk k with n_k items: hidden states from the base model (no logits), the LM head from
   `integrations.transformers.lm_head` (run as the head module's forward, `call_head`, so ZeRO-3 gathers it),
   `loss_k = algo.compute_loss(batch, hidden=h, **head)`, then
   `(loss_k * n_k / N).backward()` — the accumulated gradient is that of the mean over all N sequences
   (token_mean / prompt_mean divide by the step's counts, summed over data-parallel ranks: `MacroTotals`);
4. grad-norm clipping (the norm before clipping is logged); if the loss or the gradient norm is not finite
   the step is skipped: gradients dropped, weights, optimizer and LR schedule untouched (bit-identical),
   `skipped_steps` counted and logged;
5. AdamW step, LR schedule (linear warm-up, then constant | linear | cosine decay), weight push to the
   publisher every `sync_every_steps`, checkpoint, stats (`stats.aggregate_stats`, Ludic's grouping).

Reference model (KL terms): when given, its log-probs of the action tokens go to `batch["ref_logps"]`
through the same fused head, without gradients. ProRL-style tracking: the KL between the behaviour
policy and the reference, k3 estimate on the sampled tokens `mean(e^{ref - actor} - (ref - actor) - 1)`,
is smoothed by an exponential moving average; when it exceeds `kl_target`, or the loss's mean entropy
falls below `entropy_floor`, the reference is reset to the policy: `ref <- policy` ("hard") or
`ref <- α policy + (1 - α) ref` ("mix").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast.algorithm import RLAlgorithm
from ludic_fast.batching import (
    MacroTotals,
    collate_packed,
    collate_saw_items,
    group_index_of,
    split_items_by_token_budget,
)
from ludic_fast.checkpoint import CheckpointConfig, CheckpointManager, restore_rng, rng_tensors
from ludic_fast.distributed.macro import macro_totals_across_ranks
from ludic_fast.distributed.rank0 import Rank0Publisher
from ludic_fast.distributed.stats import reduce_stats_across_ranks
from ludic_fast.engine.guard import diverged_loss, diverged_sampling, is_sampling_divergence
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.integrations.body_kernels import apply_body_kernels, check_body_kernels_device, compile_body
from ludic_fast.integrations.packing import (
    PACKED_ATTENTION_PATHS,
    PackedAttention,
    auto_attention,
    check_packed_attention,
    half_precision_compute,
    resolve_packed_attention,
    use_sdpa_varlen,
)
from ludic_fast.integrations.transformers import LMHead, call_head, call_in_forward, final_hidden_states
from ludic_fast.memory_estimate import estimate_peak_memory
from ludic_fast.ops.budget import parse_memory_budget
from ludic_fast.stats import Reducer, aggregate_stats, group_log_stats
from ludic_fast.types import SAWBatch

log = logging.getLogger(__name__)

_SCHEDULES = ("constant", "linear", "cosine")
#: mixed_precision_dtype names -> autocast dtype
MIXED_PRECISION = {
    None: None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_REF_RESETS = ("hard", "mix")


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_pad_token_id(value: Any) -> int:
    """An int, or a tokenizer's pad_token_id (falling back to eos_token_id); ValueError otherwise."""
    if isinstance(value, bool):
        raise TypeError("pad_token_id must be an int or a tokenizer")
    if isinstance(value, int):
        return value
    if value is None:
        raise ValueError("pad_token_id is required (an int, or a tokenizer to read it from)")
    for attr in ("pad_token_id", "eos_token_id"):
        tid = getattr(value, attr, None)
        if isinstance(tid, int):
            return tid
    raise ValueError(f"pad_token_id: {type(value).__name__} has neither pad_token_id nor eos_token_id")


@dataclass
class TrainerConfig:
    """Trainer settings; Ludic master's fields and defaults where it has them (except model_device, which
    defaults to "cpu" without CUDA), then ours.

    pad_token_id: an int or a tokenizer (its pad id, else its eos id); required.
    lr_scheduler: "constant" | "linear" | "cosine" after `warmup_steps` of linear warm-up; the decaying
    schedules need `total_steps`. temperature: the head temperature of the losses, T in softmax(z / T) —
    set it to the sampling temperature so the behaviour logprobs and the losses agree.
    kl_target / entropy_floor / ref_reset / ref_mix_alpha / kl_ema_decay: ProRL reference resets (needs a
    ref_model). layout: "padded" (right padding) or "packed" (one row per micro-batch, restarting
    position_ids, attention kept within each sequence by `packed_attention`: "auto" picks flash varlen,
    a flex BlockMask or per-sequence SDPA ("sdpa_varlen", which eager / sdpa models are moved to on CPU),
    see `integrations.packing`; "mask" keeps eager / sdpa with a dense block-diagonal mask; unsupported
    models are refused). check_packing: probe the packed path once
    at construction (two sequences packed vs alone) and refuse it when inexact. body_kernels: Liger-Kernel's
    RMSNorm / RoPE / SwiGLU / GeGLU kernels on the body (`integrations.body_kernels`; None = on for a CUDA
    model_device, True on CPU is refused). compile_body: `torch.compile` each decoder layer (True: inductor,
    or a backend name). mixed_precision_dtype: None (the parameters' dtype throughout) or "bf16" / "fp16":
    the forward runs under torch.autocast in that dtype while parameters, gradients and AdamW states keep
    theirs (fp32 master weights); the head gets the hidden states and its weight cast to it; fp16 adds a
    dynamic loss scale (torch.amp.GradScaler; an overflowing step is skipped and the scale lowered).
    memory_budget: bytes (or a string like '4GiB') the LM head may hold beyond its inputs
    (`ludic_fast.ops.plan`; None: the device default); chunk_elements: the low-level override of its chunking.
    max_nonfinite_steps: a loss that is not finite this many steps in a row (or rollouts sampling from inf/nan
    probabilities) stops the run with `engine.guard.NonFiniteError` (the model diverged).
    """

    model_device: str = field(default_factory=_default_device)
    runtime_device: str | None = None
    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    max_seq_len: int = 1024
    micro_token_budget: int = 8192
    sync_every_steps: int = 1
    max_lag: int | None = None
    reduce_stats_across_ranks: bool = False
    profile_memory: bool = False
    log_every: int = 1
    pad_token_id: Any = None
    eval_at_start: bool = False
    eval_every_n_steps: int | None = None
    # ours
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    gradient_checkpointing: bool = False
    body_kernels: bool | None = None
    compile_body: bool | str = False
    mixed_precision_dtype: str | None = None
    layout: str = "padded"
    packed_attention: str = "auto"
    check_packing: bool = True
    temperature: float = 1.0
    backend: str = "auto"
    chunk_elements: int | None = None
    memory_budget: int | str | None = None
    kl_target: float | None = None
    entropy_floor: float | None = None
    kl_ema_decay: float = 0.9
    ref_reset: str = "hard"
    ref_mix_alpha: float = 0.5
    max_nonfinite_steps: int = 3

    def __post_init__(self) -> None:
        self.pad_token_id = resolve_pad_token_id(self.pad_token_id)
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.micro_token_budget <= 0 or self.micro_token_budget < self.max_seq_len:
            raise ValueError(
                f"micro_token_budget ({self.micro_token_budget}) must be > 0 and >= max_seq_len ({self.max_seq_len})"
            )
        self.memory_budget = parse_memory_budget(self.memory_budget)
        if self.lr_scheduler not in _SCHEDULES:
            raise ValueError(f"lr_scheduler must be one of {_SCHEDULES}, got {self.lr_scheduler!r}")
        if self.lr_scheduler != "constant" and not self.total_steps:
            raise ValueError(f"lr_scheduler={self.lr_scheduler!r} needs total_steps")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.layout not in ("padded", "packed"):
            raise ValueError(f"layout must be 'padded' or 'packed', got {self.layout!r}")
        if self.body_kernels not in (None, True, False):
            raise TypeError(f"body_kernels must be None (auto), True or False, got {self.body_kernels!r}")
        if self.body_kernels:
            check_body_kernels_device(self.model_device)
        if not isinstance(self.compile_body, (bool, str)) or self.compile_body == "":
            raise TypeError(f"compile_body must be a bool or a torch.compile backend name, got {self.compile_body!r}")
        if self.mixed_precision_dtype not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision_dtype must be one of {[k for k in MIXED_PRECISION if k]} or None, "
                f"got {self.mixed_precision_dtype!r}"
            )
        if self.packed_attention not in PACKED_ATTENTION_PATHS:
            raise ValueError(f"packed_attention must be one of {PACKED_ATTENTION_PATHS}, got {self.packed_attention!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.ref_reset not in _REF_RESETS:
            raise ValueError(f"ref_reset must be one of {_REF_RESETS}, got {self.ref_reset!r}")
        if not 0.0 < self.ref_mix_alpha <= 1.0:
            raise ValueError(f"ref_mix_alpha must lie in (0, 1], got {self.ref_mix_alpha}")
        if not 0.0 <= self.kl_ema_decay < 1.0:
            raise ValueError(f"kl_ema_decay must lie in [0, 1), got {self.kl_ema_decay}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")


def _is_data_parallel(model: nn.Module) -> bool:
    """Whether ranks average `model`'s gradients: DDP, FSDP1 or FSDP2 (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule))


def lr_lambda(cfg: TrainerConfig) -> Callable[[int], float]:
    """LR multiplier at optimizer step s: s/warmup during warm-up, then 1 | linear to 0 | cosine to 0."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler == "constant":
            return 1.0
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.lr_scheduler == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """Ludic-shaped trainer on the fused head (steps in the module docstring).

    batch_source: `async next_batch() -> SAWBatch` (optionally `state_dict()` / `load_state_dict()` for
    exact resume). publisher: `publish(params: dict[str, Tensor], version: int)` (a rollout engine),
    required when `sync_every_steps > 0`. evaluator: `evaluate() -> dict[str, float]` (sync or async).
    ref_model: a frozen copy for KL terms. lora_config: a `peft.LoraConfig` to wrap the model with.
    resume_from: a step (int or digit string), a checkpoint path, or "latest".
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        algo: RLAlgorithm,
        batch_source: Any,
        cfg: TrainerConfig,
        publisher: Any = None,
        param_filter: Callable[[str, Tensor], bool] | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        resume_from: int | str | None = None,
        train_logger: Any = None,
        reducers: Mapping[str, Reducer] | None = None,
        evaluator: Any = None,
        ref_model: nn.Module | None = None,
        lora_config: Any = None,
    ):
        if not isinstance(cfg, TrainerConfig):
            raise TypeError(f"cfg must be a TrainerConfig, got {type(cfg).__name__}")
        if cfg.sync_every_steps > 0 and publisher is None:
            raise ValueError("sync_every_steps > 0 needs a PolicyPublisher (publisher=...); pass sync_every_steps=0")
        if (cfg.eval_at_start or cfg.eval_every_n_steps) and evaluator is None:
            raise ValueError("eval_at_start / eval_every_n_steps need an evaluator")
        if resume_from is not None and checkpoint_config is None:
            raise ValueError("resume_from needs a checkpoint_config")
        if (cfg.kl_target is not None or cfg.entropy_floor is not None) and ref_model is None:
            raise ValueError("kl_target / entropy_floor reset a reference model: pass ref_model")
        self.cfg = cfg
        self.algo = algo
        self.batch_source = batch_source
        # under DDP/FSDP2 every rank runs the trainer: gather shards, strip `module.`, publish from rank 0 only
        wrap = publisher is not None and not isinstance(publisher, Rank0Publisher)
        self.publisher = Rank0Publisher(publisher) if wrap else publisher
        self.param_filter = param_filter
        self.train_logger = train_logger
        self.reducers = dict(reducers or {})
        self.evaluator = evaluator
        self.device = torch.device(cfg.model_device)
        if lora_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora_config)
        self.model = model.to(self.device)
        self.ref_model = None if ref_model is None else ref_model.to(self.device).eval().requires_grad_(False)
        self.body_kernels = self._apply_body_kernels()
        if cfg.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        self.amp_dtype = MIXED_PRECISION[cfg.mixed_precision_dtype]
        self.scaler = torch.amp.GradScaler(self.device.type) if self.amp_dtype is torch.float16 else None
        self.packing = self.ref_packing = None
        if cfg.layout == "packed":  # before compiling: it may switch the attention implementation, then probes
            self.packing = self._packed_attention(self.model, training=True)
            if self.ref_model is not None:
                self.ref_packing = self._packed_attention(self.ref_model, training=False)
        if cfg.compile_body:
            backend = "inductor" if cfg.compile_body is True else cfg.compile_body
            for m in (self.model, self.ref_model):
                if m is not None:
                    compile_body(m, backend=backend)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.memory_estimate = estimate_peak_memory(
            self.model,
            micro_tokens=cfg.micro_token_budget,
            compute_dtype=self.amp_dtype,
            gradient_checkpointing=cfg.gradient_checkpointing,
            chunk_elements=cfg.chunk_elements,
            memory_budget=cfg.memory_budget,
            backend=cfg.backend,
            device=self.device,
        )
        self.optimizer.zero_grad(set_to_none=True)
        self.step_idx = 0
        self.skipped_steps = 0
        self.nonfinite_in_row = 0
        self.stopped_by: str | None = None
        self.ref_resets = 0
        self.kl_ref_ema: float | None = None
        self.checkpointer = None if checkpoint_config is None else CheckpointManager(checkpoint_config)
        if resume_from is not None:
            self.resume(resume_from)

    # ------------------------------------------------------------------------------------------ setup
    def _apply_body_kernels(self) -> Any:
        """Liger's body kernels on the policy (and reference) model: `body_kernels` True, or None on CUDA.
        Returns the applied `BodyKernelPlan` (None: off, Liger missing under auto, or no patch for the type)."""
        wanted = self.cfg.body_kernels if self.cfg.body_kernels is not None else self.device.type == "cuda"
        if not wanted:
            return None
        if self.cfg.body_kernels is None and importlib.util.find_spec("liger_kernel") is None:
            warnings.warn(
                "body_kernels (auto on CUDA): liger-kernel is not installed; the body runs unfused", stacklevel=3
            )
            return None
        plan = apply_body_kernels(self.model)
        if plan is not None and self.ref_model is not None:
            apply_body_kernels(self.ref_model)
        return plan

    def _enable_gradient_checkpointing(self) -> None:
        enable = getattr(self.model, "activation_checkpointing_enable", None) or getattr(
            self.model, "gradient_checkpointing_enable", None
        )
        if enable is None:
            raise ValueError("gradient_checkpointing needs a transformers model (gradient_checkpointing_enable)")
        enable()
        if getattr(self.model, "config", None) is not None:
            self.model.config.use_cache = False
        if hasattr(self.model, "enable_input_require_grads"):
            self.model.enable_input_require_grads()

    def _packed_attention(self, model: nn.Module, *, training: bool) -> PackedAttention:
        """The packed-attention path of `model` (`integrations.packing`), probed when `check_packing`. Under
        `packed_attention="auto"` an eager / sdpa model is first moved to flash-attention-2 or flex attention
        (CUDA) or per-sequence SDPA (`auto_attention`); `"sdpa_varlen"` moves it to per-sequence SDPA."""
        if self.cfg.packed_attention == "auto":
            half = half_precision_compute(model, self.amp_dtype)
            auto_attention(model, self.device, half=half, max_seq_len=self.cfg.max_seq_len)
        elif self.cfg.packed_attention == "sdpa_varlen":
            use_sdpa_varlen(model)
        packing = resolve_packed_attention(
            model,
            path=self.cfg.packed_attention,
            device=self.device,
            max_seq_len=self.cfg.max_seq_len,
            training=training,
        )
        if self.cfg.check_packing:
            check_packed_attention(model, packing, autocast_dtype=self.amp_dtype)
        return packing

    # ------------------------------------------------------------------------------------------ loss
    def _collate(self, chunk: list, index: Mapping[str, int], macro: MacroTotals) -> dict[str, Tensor]:
        if self.cfg.layout == "packed":
            return collate_packed(chunk, device=self.device, group_index=index, macro=macro)
        return collate_saw_items(
            chunk, pad_token_id=self.cfg.pad_token_id, device=self.device, group_index=index, macro=macro
        )

    def _model_inputs(self, batch: Mapping[str, Tensor], *, reference: bool = False) -> dict[str, Any]:
        """Forward kwargs of the policy (or reference) model: padded ids + mask, or the packed path's inputs."""
        if "cu_seqlens" not in batch:
            return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        packing = self.ref_packing if reference else self.packing
        if packing is None:
            raise ValueError("a packed batch (cu_seqlens) needs TrainerConfig(layout='packed')")
        return packing.model_inputs(batch)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _head_inputs(self, head: LMHead, hidden: Tensor) -> tuple[LMHead, Tensor]:
        """Under mixed precision, the head's weight/bias and the hidden states cast (differentiably) to the
        autocast dtype, unless the algorithm asks for an fp32 head."""
        if self.amp_dtype is None or self.algo.fp32_head:
            return head, hidden
        dt = self.amp_dtype
        bias = None if head.bias is None else head.bias.to(dt)
        return dataclasses.replace(head, weight=head.weight.to(dt), bias=bias), hidden.to(dt)

    def micro_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """(loss, stats) of one collated micro-batch through the fused head (inside the model's forward,
        so DDP/FSDP/PEFT wrappers do their work)."""

        def loss(head: LMHead, hidden: Tensor) -> tuple[Tensor, dict[str, Any]]:
            head, hidden = self._head_inputs(head, hidden)
            with torch.autocast(self.device.type, enabled=False):
                return self.algo.compute_loss(
                    batch,
                    hidden=hidden,
                    **head.kwargs(),
                    temperature=self.cfg.temperature,
                    backend=self.cfg.backend,
                    chunk_elements=self.cfg.chunk_elements,
                    memory_budget=self.cfg.memory_budget,
                )

        def run(lm: nn.Module, **inputs: Tensor) -> tuple[Tensor, dict[str, Any]]:
            return call_head(lm, loss, final_hidden_states(lm, **inputs), fp32_head=self.algo.fp32_head)

        with self._autocast():
            return call_in_forward(self.model, run, **self._model_inputs(batch))

    @torch.no_grad()
    def reference_logps(self, batch: Mapping[str, Tensor]) -> Tensor:
        """log p_ref of each action token at its position ([B, T], 0 elsewhere), through the fused head."""
        ids = batch["input_ids"]
        with self._autocast():
            hidden = final_hidden_states(self.ref_model, **self._model_inputs(batch, reference=True))
        targets = torch.where(batch["action_mask"][:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], -100))

        def logprobs(head: LMHead, h: Tensor) -> Tensor:
            head, h = self._head_inputs(head, h)
            out = head.logprobs(
                h,
                targets,
                temperature=self.cfg.temperature,
                entropy=False,
                backend=self.cfg.backend,
                chunk_elements=self.cfg.chunk_elements,
                memory_budget=self.cfg.memory_budget,
            )
            return out.logprobs

        ref = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        ref[:, 1:] = call_head(self.ref_model, logprobs, hidden[:, :-1], fp32_head=self.algo.fp32_head)
        return ref

    # ------------------------------------------------------------------------------------- one step
    async def _fetch(self) -> SAWBatch:
        """The next batch with items; batches left empty by max_lag or preprocess are skipped, counted in
        `empty_batches` (logged with the step) and reported on stderr at 1, 10, 100, ... in a row."""
        empty = 0
        while True:
            if empty in (1, 10, 100, 1000, 10000):
                log.warning(
                    "%d batch(es) in a row had every sample filtered out (max_lag / preprocess filters); "
                    "the trainer keeps fetching",
                    empty,
                )
            try:
                saw_batch = await self.batch_source.next_batch()
            except RuntimeError as exc:
                if is_sampling_divergence(exc):
                    raise diverged_sampling(self.step_idx + 1, self.optimizer.param_groups[0]["lr"]) from None
                raise
            if self.cfg.max_lag is not None:
                saw_batch.items = [
                    it
                    for it in saw_batch.items
                    if self.step_idx - it.meta.get("policy_version", self.step_idx) <= self.cfg.max_lag
                ]
            if self.algo.preprocess is not None:
                saw_batch = self.algo.preprocess(saw_batch)
            if saw_batch.items:
                rollout_ids = {it.meta.get("rollout_id") for it in saw_batch.items} - {None}
                saw_batch.meta["effective_rollouts"] = len(rollout_ids) if rollout_ids else len(saw_batch.items)
                saw_batch.meta["empty_batches"] = empty
                return saw_batch
            empty += 1

    def accumulate_gradients(self, saw_batch: SAWBatch) -> tuple[Tensor, list[dict[str, Any]], list[int], list[Tensor]]:
        """Steps 2-3 of `train_step` on a fetched batch: split, collate, `(loss_k n_k / N).backward()` per chunk.

        Replaces `saw_batch.items` by the truncated, sorted items; returns (Σ_k loss_k n_k / N detached, the
        micro-batch stats, their item counts, the per-chunk reference KL estimates). Gradients accumulate in
        `.grad` (the caller steps and zeroes them)."""
        chunks = split_items_by_token_budget(
            saw_batch.items,
            micro_token_budget=self.cfg.micro_token_budget,
            max_seq_len=self.cfg.max_seq_len,
            layout=self.cfg.layout,
        )
        saw_batch.items = [it for chunk in chunks for it in chunk]
        n_total = len(saw_batch.items)
        if n_total == 0:
            raise ValueError("no items to train on after preprocessing")
        index, macro = group_index_of(saw_batch.items), MacroTotals.of(saw_batch.items)
        if _is_data_parallel(self.model):  # DDP / FSDP1 name their group; FSDP2 uses the default one
            macro = macro_totals_across_ranks(macro, getattr(self.model, "process_group", None))
        micro_stats, sizes, kl_ref = [], [], []
        total_loss = torch.zeros((), device=self.device)
        for chunk in chunks:
            batch = self._collate(chunk, index, macro)
            if self.ref_model is not None:
                batch["ref_logps"] = self.reference_logps(batch)
                if "actor_logps" in batch:
                    kl_ref.append(_k3_on_samples(batch["ref_logps"], batch["actor_logps"], batch["action_mask"]))
            loss, stats = self.micro_loss(batch)
            scaled = loss * (len(chunk) / n_total)
            (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            total_loss += loss.detach() * (len(chunk) / n_total)
            micro_stats.append(stats)
            sizes.append(len(chunk))
        return total_loss, micro_stats, sizes, kl_ref

    async def train_step(self) -> dict[str, Any]:
        """One macro step (module docstring); returns the grouped stats (or {"train/step"} between logs)."""
        self.model.train()
        t0 = time.perf_counter()
        saw_batch = await self._fetch()
        t_fetch = time.perf_counter() - t0
        total_loss, micro_stats, sizes, kl_ref = self.accumulate_gradients(saw_batch)
        params = [p for p in self.model.parameters() if p.requires_grad]
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (the schedule moves on after it)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        loss_finite = bool(torch.isfinite(total_loss))
        finite = loss_finite and bool(torch.isfinite(grad_norm))
        self.nonfinite_in_row = 0 if loss_finite else self.nonfinite_in_row + 1
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        if self.scaler is not None:
            self.scaler.update()  # lowers the scale after an overflow (the step above was skipped)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_idx += 1
        stats = aggregate_stats(micro_stats, [saw_batch], reducers=self.reducers, micro_batch_sizes=sizes)
        if self.ref_model is not None and finite:
            self._track_reference(kl_ref, stats)
        if (
            self.publisher is not None
            and self.cfg.sync_every_steps > 0
            and self.step_idx % self.cfg.sync_every_steps == 0
        ):
            self.push_weights()
        if self.checkpointer is not None and self.checkpointer.cfg.every_n_steps > 0:
            if self.step_idx % self.checkpointer.cfg.every_n_steps == 0:
                self.save_checkpoint()
        if self.step_idx % self.cfg.log_every != 0:
            self._stop_if_diverged(lr)
            return {"train/step": self.step_idx}
        stats.update(
            grad_norm=float(grad_norm),
            train_step=self.step_idx,
            skipped_steps=float(self.skipped_steps),
            step_skipped=0.0 if finite else 1.0,
            lr=lr,
        )
        for key in (
            "oversampling_factor",
            "zvp_filter_frac",
            "rollout_rounds",
            "zero_variance_group_frac",
            "zero_weight_frac",
            "empty_batches",
        ):
            if key in saw_batch.meta:
                stats[key] = float(saw_batch.meta[key])
        if self.ref_model is not None:
            stats.update(kl_ref_ema=self.kl_ref_ema or 0.0, ref_resets=float(self.ref_resets))
        elapsed = time.perf_counter() - t0
        tokens = sum(len(it.input_ids) for it in saw_batch.items)
        stats.update(
            {
                "perf/step_time_s": elapsed,
                "perf/batch_time_s": t_fetch,
                "perf/tokens_per_s": tokens / max(elapsed - t_fetch, 1e-9),
            }
        )
        if self.cfg.profile_memory and self.device.type == "cuda":
            stats["gpu_max_mem_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.cfg.reduce_stats_across_ranks:
            stats = reduce_stats_across_ranks(stats)
            stats["train_step"] = self.step_idx
        grouped = group_log_stats(stats)
        if self.train_logger is not None:
            with contextlib.suppress(Exception):
                self.train_logger.log(self.step_idx, grouped)
        self._stop_if_diverged(lr)
        return grouped

    def _stop_if_diverged(self, lr: float) -> None:
        """NonFiniteError once the loss was not finite `max_nonfinite_steps` steps in a row."""
        if self.nonfinite_in_row >= self.cfg.max_nonfinite_steps:
            raise diverged_loss(self.step_idx, self.nonfinite_in_row, lr)

    def _track_reference(self, kl_ref: list[Tensor], stats: Mapping[str, float]) -> None:
        if kl_ref:
            kl = float(torch.stack(kl_ref).mean())
            d = self.cfg.kl_ema_decay
            self.kl_ref_ema = kl if self.kl_ref_ema is None else d * self.kl_ref_ema + (1 - d) * kl
        entropy = next((v for k, v in stats.items() if k.endswith("entropy_mean")), None)
        over_kl = (
            self.cfg.kl_target is not None and self.kl_ref_ema is not None and self.kl_ref_ema > self.cfg.kl_target
        )
        low_h = self.cfg.entropy_floor is not None and entropy is not None and entropy < self.cfg.entropy_floor
        if over_kl or low_h:
            self.reset_reference()

    @torch.no_grad()
    def reset_reference(self) -> None:
        """ref <- policy ("hard") or ref <- α policy + (1 - α) ref ("mix"); the KL average restarts."""
        policy = dict(self.model.named_parameters())
        alpha = 1.0 if self.cfg.ref_reset == "hard" else self.cfg.ref_mix_alpha
        for name, ref_p in self.ref_model.named_parameters():
            src = policy.get(name)
            if src is not None and src.shape == ref_p.shape:
                ref_p.mul_(1 - alpha).add_(src.detach().to(ref_p.dtype), alpha=alpha)
        self.ref_resets += 1
        self.kl_ref_ema = None

    # ----------------------------------------------------------------------------------- publishing
    @torch.no_grad()
    def push_weights(self) -> None:
        """publisher.publish({name: tensor on runtime_device}, version=step_idx); PEFT adapters merged."""
        peft = callable(getattr(self.model, "merge_adapter", None)) and callable(
            getattr(self.model, "unmerge_adapter", None)
        )
        device = torch.device(self.cfg.runtime_device or self.cfg.model_device)
        if peft:
            self.model.merge_adapter()
        try:
            params = {
                name: p.detach().to(device)
                for name, p in self.model.named_parameters()
                if (peft or p.requires_grad) and (self.param_filter is None or self.param_filter(name, p))
            }
        finally:
            if peft:
                self.model.unmerge_adapter()
        if params:
            self.publisher.publish(params, version=self.step_idx)

    # ---------------------------------------------------------------------------------- checkpoints
    def _state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        meta: dict[str, Any] = {
            "algorithm": self.algo.name,
            "skipped_steps": self.skipped_steps,
            "ref_resets": self.ref_resets,
            "kl_ref_ema": self.kl_ref_ema,
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "python_random": _py_random_state(),
            "config": {k: v for k, v in asdict(self.cfg).items() if isinstance(v, (int, float, str, bool, type(None)))},
        }
        if self.algo.curriculum is not None:
            meta["curriculum"] = self.algo.curriculum.state_dict()
        if hasattr(self.batch_source, "state_dict"):
            meta["batch_source"] = self.batch_source.state_dict()
        tensors = rng_tensors(self.device)
        if self.ref_model is not None:
            tensors.update({f"ref.{k}": v for k, v in self.ref_model.state_dict().items()})
        return meta, tensors

    def save_checkpoint(self) -> Any:
        """Write a checkpoint of the current step (model, optimizer, scheduler, RNG, curriculum, source)."""
        if self.checkpointer is None:
            raise ValueError("save_checkpoint needs a checkpoint_config")
        meta, tensors = self._state()
        return self.checkpointer.save(self.model, self.optimizer, step=self.step_idx, metadata=meta, tensors=tensors)

    def resume(self, resume_from: int | str) -> dict[str, Any]:
        """Load a checkpoint: an int / digit string is a step, an existing path a directory, "latest" the
        newest. Restores everything `save_checkpoint` wrote; returns its trainer state."""
        step, path = None, None
        if isinstance(resume_from, int):
            step = resume_from
        elif isinstance(resume_from, str) and resume_from != "latest":
            if resume_from.isdigit():
                step = int(resume_from)
            else:
                path = resume_from
        state = self.checkpointer.load(self.model, self.optimizer, step=step, path=path)
        self.step_idx = int(state["step"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.ref_resets = int(state.get("ref_resets", 0))
        self.kl_ref_ema = state.get("kl_ref_ema")
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        if "python_random" in state:
            random.setstate(_py_random_from_json(state["python_random"]))
        tensors = state.get("tensors", {})
        restore_rng(tensors, self.device)
        if self.ref_model is not None:
            ref = {k[len("ref.") :]: v for k, v in tensors.items() if k.startswith("ref.")}
            if ref:
                self.ref_model.load_state_dict(ref, strict=False)
        if self.algo.curriculum is not None and "curriculum" in state:
            self.algo.curriculum.load_state_dict(state["curriculum"])
        if "batch_source" in state and hasattr(self.batch_source, "load_state_dict"):
            self.batch_source.load_state_dict(state["batch_source"])
        return state

    # ----------------------------------------------------------------------------------------- loops
    async def eval(self) -> dict[str, float]:
        """Run the evaluator; its metrics become `eval/<k>` plus `eval/step`, logged as a record of their own
        at the current step (train records carry no eval values)."""
        result = self.evaluator.evaluate()
        if inspect.isawaitable(result):
            result = await result
        self.model.train()
        stats = {(k if k.startswith("eval/") else f"eval/{k}"): float(v) for k, v in result.items()}
        stats["eval/step"] = self.step_idx
        if self.train_logger is not None:
            with contextlib.suppress(Exception):
                self.train_logger.log(self.step_idx, dict(stats))
        return stats

    async def train(
        self, num_steps: int, *, log_fn: Callable[[dict], None] | None = None, stop: StopOnSignal | None = None
    ) -> list[dict[str, Any]]:
        """`num_steps` train steps (eval at start / every n steps when configured); returns each step's stats.
        A stop requested through `stop` ends the loop after the current step (and its eval), with a checkpoint
        of that step when checkpointing is on; `stopped_by` then names the signal."""
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        history = []
        if self.cfg.eval_at_start and self.evaluator is not None:
            await self.eval()
        for _ in range(num_steps):
            stats = await self.train_step()
            history.append(stats)
            if log_fn is not None:
                log_fn(stats)
            if self.cfg.eval_every_n_steps and self.step_idx % self.cfg.eval_every_n_steps == 0:
                await self.eval()
            if stop is not None and stop.requested:
                self._stop(stop)
                break
        return history

    def _stop(self, stop: StopOnSignal) -> None:
        self.stopped_by = stop.signal_name
        if self.checkpointer is not None and self.checkpointer.latest_step() != self.step_idx:
            self.save_checkpoint()

    def train_step_sync(self) -> dict[str, Any]:
        return asyncio.run(self.train_step())

    def train_sync(
        self, num_steps: int, *, log_fn: Callable[[dict], None] | None = None, stop: StopOnSignal | None = None
    ) -> list[dict[str, Any]]:
        return asyncio.run(self.train(num_steps, log_fn=log_fn, stop=stop))


def _k3_on_samples(ref: Tensor, actor: Tensor, action_mask: Tensor) -> Tensor:
    """mean over action tokens (position >= 1) of e^{ref - actor} - (ref - actor) - 1."""
    mask = action_mask[:, 1:] > 0
    d = (ref[:, 1:] - actor[:, 1:])[mask]
    if d.numel() == 0:
        return torch.zeros((), device=ref.device)
    return (torch.exp(d) - d - 1).mean()


def _py_random_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _py_random_from_json(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


__all__ = ["Trainer", "TrainerConfig", "lr_lambda", "resolve_pad_token_id"]
