"""A slim trainer for offline objectives on the fused head: preference losses, reward models, distillation.

One step: take `batch_size` examples (shuffled, cycling), split them into micro-batches of
`micro_batch_size`, and per micro-batch k of n_k examples back-propagate `loss_k · n_k / n` (the gradient
of the mean over the step's examples); clip the gradient norm; AdamW. Records carry `train/<stat>` (the
n_k-weighted mean of each micro-batch stat), `train/grad_norm`, `train/lr` and `train/step_skipped`: a step whose
loss or gradient norm is not finite is skipped (no optimizer update, weights and optimizer state untouched;
counted in `skipped_steps`), as in the RL `Trainer`.

Checkpoints (`checkpoint_config`, `ludic_fast.checkpoint`: atomic safetensors + JSON): the model, the optimizer,
the objective's own state (the reward value head; the distillation sampler's RNG), the example order and its
RNG, torch's RNG and the step; `resume_from` continues a run exactly where the checkpoint left it. The
reference model and the teacher are frozen and not saved: the caller rebuilds them as for the first run.

Objectives (`Objective`): how examples are collated and how a micro-batch's loss is computed.
- `PreferenceObjective(loss_fn, ref_model)`: DPO / IPO / SimPO / ORPO on pairs, KTO on KTO examples; the
  reference model's log-probs come from the fused head without gradients, once per pair (cached sums in
  `batch['ref_seq_logps']`; KTO: per batch, in `batch['ref_logps']`).
- `RewardObjective(value_head)`: Bradley-Terry on the last-token value head over the backbone's hidden states.
- `DistillObjective(teacher, ...)`: `linear_divergence` on the completion tokens, teacher hidden states
  under no_grad; `on_policy_fraction` λ replaces each example's completion by a sample of the student with
  probability λ (GKD, Agarwal et al., arXiv 2306.13649: the student samples, the teacher scores).
Layouts padded or packed (`OfflineConfig.layout`; packed runs the model on exact packed-attention inputs,
an eager / sdpa model first moved to the implementation that skips masked work, `packing.auto_attention`);
fp32, or `mixed_precision='bf16'` (the model's forward under autocast, the fused head on bf16 casts of the
hidden states and head weight, fp32 master weights); models are transformers causal LMs.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ludic_fast.checkpoint import CheckpointConfig, CheckpointManager, restore_rng, rng_tensors
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.integrations.packing import auto_attention, half_precision_compute, resolve_packed_attention
from ludic_fast.integrations.transformers import final_hidden_states, lm_head
from ludic_fast.ops import linear_logprobs
from ludic_fast.ops.divergence import linear_divergence
from ludic_fast.pair_batching import collate_completions, collate_kto, collate_pairs
from ludic_fast.preference import DPOLoss, IPOLoss, KTOLoss
from ludic_fast.reward_model import BradleyTerryLoss
from ludic_fast.token_batch import TokenBatch


@dataclass
class OfflineConfig:
    """Settings of `OfflineTrainer`."""

    steps: int = 40
    batch_size: int = 16
    micro_batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int | None = 64
    pad_token_id: int = 0
    seed: int = 0
    device: str = "cpu"
    chunk_elements: int | None = None
    memory_budget: int | None = None  # bytes of the head's transient chunks (None: the default plan)
    layout: str = "padded"  # or "packed" (no padding; exact packed attention, `integrations.packing`)
    mixed_precision: str | None = None  # "bf16": the model's forward under autocast, the head in bf16

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.layout not in ("padded", "packed"):
            raise ValueError(f"layout must be 'padded' or 'packed', got {self.layout!r}")
        if self.mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision must be None or 'bf16' (fp16 would need a gradient scaler), "
                             f"got {self.mixed_precision!r}")

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.mixed_precision == "bf16" else None


class Objective(Protocol):
    def parameters(self) -> list[nn.Parameter]: ...

    def prepare(self, model: nn.Module, examples: list[Any]) -> list[Any]: ...

    def collate(self, examples: list[Any], cfg: OfflineConfig) -> dict[str, Tensor]: ...

    def loss(self, model: nn.Module, batch: dict[str, Tensor], cfg: OfflineConfig) -> tuple[Tensor, dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _hidden(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Final hidden states of a padded batch, or of a packed one through the model's exact packed-attention
    inputs (`integrations.packing`: sequences never attend each other)."""
    if "cu_seqlens" not in batch:
        return final_hidden_states(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    packing = resolve_packed_attention(model, device=batch["input_ids"].device, training=model.training)
    return final_hidden_states(model, **packing.model_inputs(batch))


def _head_inputs(model: nn.Module, hidden: Tensor, cfg: OfflineConfig | None) -> tuple[Tensor, dict[str, Any]]:
    """(hidden, head kwargs) for the fused head: under mixed precision both cast (differentiably) to bf16."""
    kw = lm_head(model).kwargs()
    dt = None if cfg is None else cfg.amp_dtype
    if dt is None:
        return hidden, kw
    kw["weight"] = kw["weight"].to(dt)
    kw["bias"] = None if kw["bias"] is None else kw["bias"].to(dt)
    return hidden.to(dt), kw


def _no_autocast(x: Tensor) -> contextlib.AbstractContextManager:
    """The head runs outside autocast: it picks its own precisions (inputs cast by `_head_inputs`)."""
    return torch.autocast(x.device.type, enabled=False)


@torch.no_grad()
def reference_logps(ref_model: nn.Module, batch: dict[str, Tensor], cfg: OfflineConfig | None = None) -> Tensor:
    """log p_ref of every action token at its position (shape of input_ids, 0 elsewhere), padded or packed,
    through the fused head."""
    tb = TokenBatch.from_batch(batch)
    hidden, kw = _head_inputs(ref_model, _hidden(ref_model, batch), cfg)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, tb.rows)
    with _no_autocast(rows):
        out = linear_logprobs(rows, kw.pop("weight"), tb.targets, entropy=False, **kw)
    ref = torch.zeros(batch["input_ids"].numel(), dtype=torch.float32, device=rows.device)
    ref[tb.rows + 1] = out.logprobs
    return ref.reshape(batch["input_ids"].shape)


class _Base:
    def parameters(self) -> list[nn.Parameter]:
        return []

    def prepare(self, model: nn.Module, examples: list[Any]) -> list[Any]:
        return examples

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state a resumed run needs (tensors of trainable objective parameters are saved apart)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rng: random.Random, state: list[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


@dataclass
class PreferenceObjective(_Base):
    """A `ludic_fast.preference` loss on pairs (KTOLoss: on KTO examples with in-batch KL samples).

    The reference model scores each pair once: its sequence sums are cached by example and reach the loss as
    `batch['ref_seq_logps']`. KTO's KL samples depend on the batch's pairing, so KTO reads per-token
    `batch['ref_logps']` computed for each batch."""

    loss_fn: Any
    ref_model: nn.Module | None = None
    _ref_cache: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.loss_fn, (DPOLoss, IPOLoss, KTOLoss)) and self.ref_model is None:
            raise ValueError(f"{type(self.loss_fn).__name__} needs ref_model (a frozen copy of the initial policy)")

    def collate(self, examples, cfg):
        kw = dict(pad_token_id=cfg.pad_token_id, max_length=cfg.max_length, device=cfg.device)
        if isinstance(self.loss_fn, KTOLoss):
            return collate_kto(examples, layout=cfg.layout, **kw)
        batch = collate_pairs(examples, layout=cfg.layout, **kw)
        if self.ref_model is not None:
            missing = [e for e in examples if id(e) not in self._ref_cache]
            if missing:
                fresh = collate_pairs(missing, **kw)
                sums = (reference_logps(self.ref_model, fresh, cfg) * fresh["action_mask"]).sum(1)
                self._ref_cache.update({id(e): sums[2 * i:2 * i + 2] for i, e in enumerate(missing)})
            batch["ref_seq_logps"] = torch.cat([self._ref_cache[id(e)] for e in examples])
        return batch

    def loss(self, model, batch, cfg):
        if self.ref_model is not None and isinstance(self.loss_fn, KTOLoss):
            batch["ref_logps"] = reference_logps(self.ref_model, batch, cfg)
        hidden, kw = _head_inputs(model, _hidden(model, batch), cfg)
        with _no_autocast(hidden):
            return self.loss_fn(batch, hidden=hidden, **kw, chunk_elements=cfg.chunk_elements,
                                memory_budget=cfg.memory_budget)


@dataclass
class RewardObjective(_Base):
    """Bradley-Terry on a value head (nn.Linear(D, 1)) over the backbone's final hidden states."""

    value_head: nn.Linear
    loss_fn: BradleyTerryLoss | None = None

    def parameters(self):
        return list(self.value_head.parameters())

    def collate(self, examples, cfg):
        return collate_pairs(examples, layout=cfg.layout, pad_token_id=cfg.pad_token_id, max_length=cfg.max_length,
                             device=cfg.device)

    def loss(self, model, batch, cfg):
        fn = self.loss_fn or BradleyTerryLoss()
        hidden = _hidden(model, batch)
        with _no_autocast(hidden):
            return fn(batch, hidden=hidden, weight=self.value_head.weight, bias=self.value_head.bias)


@dataclass
class DistillObjective(_Base):
    """linear_divergence(student, teacher) on the completion tokens (module docstring)."""

    teacher: nn.Module
    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    hard_weight: float = 0.0
    on_policy_fraction: float = 0.0
    max_new_tokens: int = 4
    eos_token_id: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"on_policy_fraction must lie in [0, 1], got {self.on_policy_fraction}")
        self._rng = random.Random(self.seed)

    @torch.no_grad()
    def prepare(self, model, examples):
        """Replace completions by the student's samples (eval mode) with probability on_policy_fraction."""
        out, was_training = [], model.training
        model.eval()
        for prompt, completion in examples:
            if self.on_policy_fraction > 0 and self._rng.random() < self.on_policy_fraction:
                ids = torch.tensor([prompt], device=next(model.parameters()).device)
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_id,
                                     pad_token_id=self.eos_token_id)
                completion = gen[0, len(prompt):].tolist() or completion
            out.append((prompt, completion))
        model.train(was_training)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _rng_state(self._rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rng" in state:
            _set_rng_state(self._rng, state["rng"])

    def collate(self, examples, cfg):
        prompts, completions = zip(*examples)
        return collate_completions(prompts, completions, layout=cfg.layout, pad_token_id=cfg.pad_token_id,
                                   max_length=cfg.max_length, device=cfg.device)

    def loss(self, model, batch, cfg):
        tb = TokenBatch.from_batch(batch)  # the completion tokens' rows and targets (never across a boundary)
        for m in (model, self.teacher):
            head = lm_head(m)
            if head.softcap is not None or head.logit_scale != 1.0:
                raise ValueError(f"{type(m).__name__}: linear_divergence takes plain linear heads (no logit scale "
                                 "or final softcap)")
        hs, s_kw = _head_inputs(model, _hidden(model, batch), cfg)
        hs = hs.reshape(-1, hs.shape[-1]).index_select(0, tb.rows)
        with torch.no_grad():
            ht, t_kw = _head_inputs(self.teacher, _hidden(self.teacher, batch), cfg)
            ht = ht.reshape(-1, ht.shape[-1]).index_select(0, tb.rows)
        with _no_autocast(hs):
            loss = linear_divergence(hs, s_kw["weight"], ht, t_kw["weight"], tb.targets, kind=self.kind,
                                     beta=self.beta, temperature=self.temperature, hard_weight=self.hard_weight,
                                     b_student=s_kw["bias"], b_teacher=t_kw["bias"], memory_budget=cfg.memory_budget)
        return loss, {"loss": loss.detach(), "tokens": float(tb.n)}


class OfflineTrainer:
    """The loop of the module docstring; `train()` runs the steps left up to `cfg.steps` and returns their
    records (and logs them). resume_from: a step (int or digit string), a checkpoint path, or "latest"."""

    def __init__(self, model: nn.Module, objective: Objective, examples: Sequence[Any], cfg: OfflineConfig,
                 logger: Any = None, checkpoint_config: CheckpointConfig | None = None,
                 resume_from: int | str | None = None):
        if not examples:
            raise ValueError("examples must not be empty")
        if resume_from is not None and checkpoint_config is None:
            raise ValueError("resume_from needs a checkpoint_config")
        self.model, self.objective, self.examples, self.cfg, self.logger = model, objective, list(examples), cfg, logger
        params = [p for p in model.parameters() if p.requires_grad] + objective.parameters()
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.params = params
        self._rng = random.Random(cfg.seed)
        self._order: list[int] = []
        self.step_idx = 0
        self.skipped_steps = 0
        self.stopped_by: str | None = None
        self.checkpointer = None if checkpoint_config is None else CheckpointManager(checkpoint_config)
        if cfg.layout == "packed":  # as the RL Trainer's packed_attention="auto": skip masked attention work
            half = half_precision_compute(model, cfg.amp_dtype)
            auto_attention(model, cfg.device, half=half, max_seq_len=cfg.max_length)
        if resume_from is not None:
            self.resume(resume_from)

    def _autocast(self) -> contextlib.AbstractContextManager:
        dt = self.cfg.amp_dtype
        return contextlib.nullcontext() if dt is None else torch.autocast(torch.device(self.cfg.device).type, dtype=dt)

    def _next_examples(self) -> list[Any]:
        out = []
        while len(out) < self.cfg.batch_size:
            if not self._order:
                self._order = list(range(len(self.examples)))
                self._rng.shuffle(self._order)
            out.append(self.examples[self._order.pop()])
        return out

    def step(self) -> dict[str, float]:
        self.model.train()
        examples = self.objective.prepare(self.model, self._next_examples())
        n, m = len(examples), self.cfg.micro_batch_size
        totals: dict[str, float] = {}
        total_loss = 0.0
        for k in range(0, n, m):
            chunk = examples[k:k + m]
            batch = self.objective.collate(chunk, self.cfg)
            with self._autocast():
                loss, stats = self.objective.loss(self.model, batch, self.cfg)
            (loss * (len(chunk) / n)).backward()
            total_loss += float(loss.detach()) * len(chunk) / n
            for key, v in stats.items():
                totals[key] = totals.get(key, 0.0) + float(v) * len(chunk) / n
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        finite = math.isfinite(total_loss) and bool(torch.isfinite(norm))
        if finite:
            self.opt.step()
        else:
            self.skipped_steps += 1
        self.opt.zero_grad(set_to_none=True)
        self.step_idx += 1
        record = {f"train/{k}": v for k, v in totals.items()}
        record.update({"train/grad_norm": float(norm), "train/lr": self.cfg.lr,
                       "train/step_skipped": 0.0 if finite else 1.0})
        if self.checkpointer is not None and self.checkpointer.cfg.every_n_steps > 0:
            if self.step_idx % self.checkpointer.cfg.every_n_steps == 0:
                self.save_checkpoint()
        return record

    def train(self, stop: StopOnSignal | None = None) -> list[dict[str, float]]:
        """The steps left up to `cfg.steps`; a stop requested through `stop` ends the loop after the current
        step, with a checkpoint of that step when checkpointing is on (`stopped_by` names the signal)."""
        records = []
        while self.step_idx < self.cfg.steps:
            rec = self.step()
            records.append(rec)
            if self.logger is not None:
                self.logger.log(self.step_idx, rec)
            if stop is not None and stop.requested:
                self.stopped_by = stop.signal_name
                if self.checkpointer is not None and self.checkpointer.latest_step() != self.step_idx:
                    self.save_checkpoint()
                break
        return records

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Any:
        """Write a checkpoint of the current step (module docstring: what it holds)."""
        if self.checkpointer is None:
            raise ValueError("save_checkpoint needs a checkpoint_config")
        meta = {"skipped_steps": self.skipped_steps, "order": list(self._order), "rng": _rng_state(self._rng),
                "objective": self.objective.state_dict()}
        tensors = rng_tensors(self.cfg.device)
        tensors.update({f"objective.{i}": p.detach() for i, p in enumerate(self.objective.parameters())})
        return self.checkpointer.save(self.model, self.opt, step=self.step_idx, metadata=meta, tensors=tensors)

    def resume(self, resume_from: int | str) -> dict[str, Any]:
        """Load a checkpoint (an int / digit string: a step; "latest": the newest; else a directory) and
        restore everything `save_checkpoint` wrote; returns its trainer state."""
        if self.checkpointer is None:
            raise ValueError("resume needs a checkpoint_config")
        step = path = None
        if isinstance(resume_from, int) or (isinstance(resume_from, str) and resume_from.isdigit()):
            step = int(resume_from)
        elif resume_from != "latest":
            path = resume_from
        state = self.checkpointer.load(self.model, self.opt, step=step, path=path)
        tensors = state.get("tensors", {})
        with torch.no_grad():
            for i, p in enumerate(self.objective.parameters()):
                if f"objective.{i}" in tensors:
                    p.copy_(tensors[f"objective.{i}"])
        self.step_idx = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if "order" in state:
            self._order = [int(i) for i in state["order"]]
        if "rng" in state:
            _set_rng_state(self._rng, state["rng"])
        self.objective.load_state_dict(state.get("objective", {}))
        restore_rng(tensors, self.cfg.device)
        return state


__all__ = ["OfflineConfig", "OfflineTrainer", "PreferenceObjective", "RewardObjective", "DistillObjective",
           "reference_logps"]
