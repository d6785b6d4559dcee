"""The one training engine: `Engine` runs an `Objective` (`engine.objective`, `ludic_fast.objectives`) on a
model through the fused head. It knows no objective: the RL trainer (`ludic_fast.trainer.Trainer`) is this
engine on the RL objective.

It owns the model (LoRA, body kernels, gradient checkpointing, packed attention, compile:
`engine.model_setup`), precision (fp32, or bf16 / fp16 autocast with fp32 master weights, fp16 with a dynamic
loss scale), AdamW and the LR schedule (`engine.schedule`), the memory estimate, checkpoints with exact resume,
logging, evaluation, the weight push to a rollout engine, stop-on-signal (`engine.stop`) and the non-finite
guard (`engine.guard`). One optimizer step (`train_step`), whole:

    batch = await objective.next_batch(self)
    micros = objective.micro_batches(self, batch)                      # N examples in chunks of n_k
    for m in micros: (objective.loss(self, m.batch) · n_k / N).backward()   # grad of the step's mean
    clip the gradient norm (logged before clipping); if the loss or the norm is not finite the step is
    skipped (weights, optimizer, schedule bit-identical), else AdamW step and schedule step
    push weights every `sync_every_steps`, checkpoint every `every_n_steps`, log the step's record

Throughput, logged for every objective: `perf/tokens` is the number of non-pad tokens of the step's
micro-batches (the sum of attention_mask; packed: of the sequence lengths), `perf/examples` the number of
examples (`MicroBatch.examples`: RL items, pairs, completions); `perf/tokens_per_s` and `perf/examples_per_s`
divide them by the step's compute time, `perf/step_time_s - perf/batch_time_s` (the step without fetching
its batch: forwards of the policy and of frozen models, backward, optimizer step, weight push, checkpoint).

DDP / FSDP1 / FSDP2: wrap the model before handing it over; the loss runs inside the model's forward
(`call_in_forward`), so the wrappers gather and reduce as usual. Every rank then runs the same number of
micro-batches (a rank with fewer repeats its last with weight 0, as FSDP gathers in every forward), parameters
outside the model (a value head) get their gradients averaged, the non-finite guard acts on every rank when
any rank's loss is not finite, an objective that samples from the policy (`samples_policy`) and the evaluator
see FSDP2's parameters whole (`distributed.launch.full_parameters`), and checkpoints are sharded
(`run.sharded_checkpoint`) unless `CheckpointConfig(sharded=False)`. An objective with `global_mean` divides
by its sizes summed over the ranks (a token mean over every rank's tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from ludic_fast.distributed.launch import average_gradients, full_parameters, global_max, global_sum
from ludic_fast.distributed.rank0 import Rank0Publisher
from ludic_fast.distributed.stats import reduce_stats_across_ranks
from ludic_fast.engine import model_setup
from ludic_fast.engine.config import MIXED_PRECISION, EngineConfig
from ludic_fast.engine.guard import diverged_loss, no_action_tokens
from ludic_fast.engine.memory_estimate import estimate_peak_memory
from ludic_fast.engine.objective import MicroBatch, Objective, T
from ludic_fast.engine.publisher import PolicyPublisher, policy_params
from ludic_fast.engine.schedule import lr_lambda
from ludic_fast.engine.step_parts import grad_norm_and_clip, make_adamw, read_step_values
from ludic_fast.engine.stop import StopOnSignal, StopRequested
from ludic_fast.integrations.transformers import LMHead, call_head, call_in_forward, final_hidden_states
from ludic_fast.run.checkpoint import (
    CheckpointConfig,
    CheckpointManager,
    random_state,
    restore_rng,
    rng_tensors,
    set_random_state,
)
from ludic_fast.run.sharded_checkpoint import ShardedCheckpointManager
from ludic_fast.run.stats import group_log_stats


def _action_tokens(micros: Sequence[MicroBatch]) -> dict[str, Tensor]:
    """{"n": the action tokens of the step's micro-batches (action_mask at positions >= 1) as a 0-d tensor}, read
    with the step's values (`read_step_values` replaces it by a float); {} when a micro-batch has no action_mask."""
    if not micros or any("action_mask" not in m.batch for m in micros):
        return {}
    return {"n": torch.stack([m.batch["action_mask"][..., 1:].sum().float() for m in micros]).sum()}


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ranks average `model`'s gradients: DDP, FSDP1 or FSDP2 (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule))


class Engine:
    """The engine (module docstring) on `objective`.

    publisher: a `PolicyPublisher` (a rollout engine taking new weights), required when
    `sync_every_steps > 0`. evaluator: `evaluate() -> dict[str, float]` (sync or async). lora_config: a
    `peft.LoraConfig` to wrap the model with. resume_from: a step (int or digit string), a checkpoint path,
    or "latest". What an objective may read of it: `engine.objective.EngineView`.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        cfg: EngineConfig,
        objective: Objective,
        publisher: PolicyPublisher | None = None,
        param_filter: Callable[[str, Tensor], bool] | None = None,
        checkpoint_config: CheckpointConfig | None = None,
        resume_from: int | str | None = None,
        train_logger: Any = None,
        evaluator: Any = None,
        lora_config: Any = None,
    ):
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg must be an EngineConfig, got {type(cfg).__name__}")
        if publisher is not None and not isinstance(publisher, PolicyPublisher):
            raise TypeError(f"publisher must have publish(params, version) (a PolicyPublisher), got "
                            f"{type(publisher).__name__}")
        if cfg.sync_every_steps > 0 and publisher is None:
            raise ValueError("sync_every_steps > 0 needs a PolicyPublisher (publisher=...); pass sync_every_steps=0")
        if (cfg.eval_at_start or cfg.eval_every_n_steps) and evaluator is None:
            raise ValueError("eval_at_start / eval_every_n_steps need an evaluator")
        if resume_from is not None and checkpoint_config is None:
            raise ValueError("resume_from needs a checkpoint_config")
        self.cfg = cfg
        self.objective = objective
        # under DDP/FSDP2 every rank runs the trainer: gather shards, strip `module.`, publish from rank 0 only
        # (a publisher with `every_rank = True` serves its own rank: an engine sampling from the trainer's model)
        wrap = (publisher is not None and not isinstance(publisher, Rank0Publisher)
                and not getattr(publisher, "every_rank", False))
        self.publisher = Rank0Publisher(publisher) if wrap else publisher
        self.param_filter = param_filter
        self.train_logger = train_logger
        self.evaluator = evaluator
        self.device = torch.device(cfg.model_device)
        self.model = model_setup.with_lora(model, lora_config).to(self.device)
        self.data_parallel = is_data_parallel(self.model)
        frozen = [m.to(self.device) for m in objective.frozen_models()]
        for p in objective.parameters():
            p.data = p.data.to(self.device)
        self.body_kernels = model_setup.body_kernels(cfg, self.device, [self.model, *frozen])
        if cfg.gradient_checkpointing:
            model_setup.enable_gradient_checkpointing(self.model)
        self.amp_dtype = MIXED_PRECISION[cfg.mixed_precision_dtype]
        self.scaler = torch.amp.GradScaler(self.device.type) if self.amp_dtype is torch.float16 else None
        self.packing = None
        self._frozen_packing: dict[int, Any] = {}
        if cfg.layout == "packed":  # before compiling: it may switch the attention implementation, then probes
            self.packing = model_setup.packed_attention(cfg, self.device, self.amp_dtype, self.model)
            for m in frozen:
                self._frozen_packing[id(m)] = model_setup.packed_attention(cfg, self.device, self.amp_dtype, m)
        model_setup.compile_layers(cfg, [self.model, *frozen])
        self.params = [p for p in self.model.parameters() if p.requires_grad] + list(objective.parameters())
        self.optimizer = make_adamw(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas),
                                    eps=cfg.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.memory_estimate = estimate_peak_memory(
            self.model, micro_tokens=cfg.micro_token_budget, compute_dtype=self.amp_dtype,
            gradient_checkpointing=cfg.gradient_checkpointing, chunk_elements=cfg.chunk_elements,
            memory_budget=cfg.memory_budget, backend=cfg.backend, device=self.device,
        )
        self.optimizer.zero_grad(set_to_none=True)
        self.step_idx = 0
        self.skipped_steps = 0
        self.nonfinite_in_row = 0
        self.stopped_by: str | None = None
        #: the stop of the running `train` call (None outside one): objectives that refetch batches check it
        self.stop_signal: StopOnSignal | None = None
        self.checkpointer = None
        if checkpoint_config is not None:
            sharded = checkpoint_config.sharded if checkpoint_config.sharded is not None else self.data_parallel
            # a sharded checkpoint stores the objective's own parameters (a value head) with their optimizer state
            self.checkpointer = (ShardedCheckpointManager(checkpoint_config, extra=list(objective.parameters()))
                                 if sharded else CheckpointManager(checkpoint_config))
        if resume_from is not None:
            self.resume(resume_from)

    # ------------------------------------------------------------------------- forward and the head
    def _model_inputs(self, batch: Mapping[str, Tensor], model: nn.Module | None = None) -> dict[str, Any]:
        """Forward kwargs of the policy (or a frozen model): padded ids + mask, or the packed path's inputs."""
        if "cu_seqlens" not in batch:
            return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        packing = self.packing if model is None else self._frozen_packing.get(id(model))
        if packing is None:
            raise ValueError("a packed batch (cu_seqlens) needs EngineConfig(layout='packed')")
        return packing.model_inputs(batch)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _head_inputs(self, head: LMHead, hidden: Tensor, fp32_head: bool) -> tuple[LMHead, Tensor]:
        """Under mixed precision, the head's weight/bias and the hidden states cast (differentiably) to the
        autocast dtype, unless the objective asks for an fp32 head."""
        if self.amp_dtype is None or fp32_head:
            return head, hidden
        dt = self.amp_dtype
        bias = None if head.bias is None else head.bias.to(dt)
        return dataclasses.replace(head, weight=head.weight.to(dt), bias=bias), hidden.to(dt)

    def head_loss(self, batch: Mapping[str, Tensor], fn: Callable[[LMHead, Tensor], T], *,
                  fp32_head: bool = False) -> T:
        """fn(head, hidden) on the policy's final hidden states, run inside the model's forward (so DDP / FSDP
        / PEFT wrappers do their work), head inputs in the compute precision, outside autocast."""

        def head_fn(head: LMHead, hidden: Tensor) -> T:
            head, hidden = self._head_inputs(head, hidden, fp32_head)
            with torch.autocast(self.device.type, enabled=False):
                return fn(head, hidden)

        def run(lm: nn.Module, **inputs: Tensor) -> T:
            with record_function("step/body_forward"):
                hidden = final_hidden_states(lm, **inputs)
            with record_function("step/head_loss"):
                return call_head(lm, head_fn, hidden, fp32_head=fp32_head)

        with self._autocast():
            return call_in_forward(self.model, run, **self._model_inputs(batch))

    def micro_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """(loss, stats) of one collated micro-batch: the objective's loss on the fused head."""
        return self.objective.loss(self, batch)

    @torch.no_grad()
    def frozen_head(self, model: nn.Module, batch: Mapping[str, Tensor], fn: Callable[[LMHead, Tensor], T], *,
                    fp32_head: bool = False) -> T:
        """fn(head, hidden) of a frozen model (reference, teacher), without gradients, as `head_loss`."""
        with self._autocast():
            hidden = final_hidden_states(model, **self._model_inputs(batch, model))

        def head_fn(head: LMHead, h: Tensor) -> T:
            head, h = self._head_inputs(head, h, fp32_head)
            return fn(head, h)

        return call_head(model, head_fn, hidden, fp32_head=fp32_head)

    def _whole_parameters(self, sampling: bool) -> contextlib.AbstractContextManager:
        """FSDP2's parameters gathered for sampling from the policy (a no-op otherwise)."""
        return full_parameters(self.model) if sampling and self.data_parallel else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------- one step
    def accumulate_gradients(self, batch: Any) -> tuple[Tensor, list[dict[str, Any]], list[int], list[Any]]:
        """The micro-batch loop of a fetched batch: `(loss_k n_k / N).backward()` per micro-batch. Returns
        (Σ_k loss_k n_k / N detached, the micro-batch stats, their sizes, their aux values). Gradients
        accumulate in `.grad` (the caller steps and zeroes them)."""
        return self._backward(self.objective.micro_batches(self, batch))

    def _backward(self, micros: Sequence[MicroBatch]) -> tuple[Tensor, list[dict[str, Any]], list[int], list[Any]]:
        n_total = sum(m.size for m in micros)
        passes = len(micros)
        if self.data_parallel:  # every rank runs as many forwards (FSDP gathers in each); sizes over all ranks
            passes = int(global_max(passes))
            if getattr(self.objective, "global_mean", False):
                n_total = global_sum(n_total) / torch.distributed.get_world_size()
        total_loss = torch.zeros((), device=self.device)
        micro_stats = []
        for i in range(passes):
            m = micros[min(i, len(micros) - 1)]
            weight = m.size / n_total if i < len(micros) else 0.0  # a repeat only keeps the ranks in step
            with record_function("step/forward_loss"):
                loss, stats = self.micro_loss(m.batch)
            scaled = loss * weight
            with record_function("step/backward"):
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            if i < len(micros):
                total_loss += loss.detach() * weight
                micro_stats.append(stats)
        if self.data_parallel:
            average_gradients(list(self.objective.parameters()))
        return total_loss, micro_stats, [m.size for m in micros], [m.aux for m in micros]

    async def train_step(self) -> dict[str, Any]:
        """One optimizer step (module docstring); returns the grouped stats (or {"train/step"} between logs)."""
        self.model.train()
        t0 = time.perf_counter()
        with self._whole_parameters(getattr(self.objective, "samples_policy", False)):
            batch = await self.objective.next_batch(self)
        t_fetch = time.perf_counter() - t0
        with record_function("step/collate"):
            micros = self.objective.micro_batches(self, batch)
        total_loss, micro_stats, sizes, aux = self._backward(micros)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (the schedule moves on after it)
        with record_function("step/clip"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            grad_norm_t = grad_norm_and_clip(self.params, self.cfg.max_grad_norm)
        actions = _action_tokens(micros)
        with record_function("step/host_read"):  # the step's one host sync: the skip decision and the stats
            loss, grad_norm, tokens = read_step_values(total_loss, grad_norm_t, [m.batch for m in micros],
                                                       [*micro_stats, actions], self.device)
        loss_finite, empty = math.isfinite(loss), actions.get("n") == 0
        if self.data_parallel:  # one collective: every rank skips, gives up, or refuses at the same step
            worst = global_max(2.0 * (not loss_finite) + (not empty))  # >= 2: a rank's loss is not finite
            loss_finite, empty = worst < 2, worst == 0  # 0: every rank's batch is empty (and its loss 0)
        if empty:  # the empty-batch guard (engine.guard), before the optimizer step
            raise no_action_tokens(self.step_idx + 1, sum(m.size if m.examples is None else m.examples
                                                          for m in micros), self.cfg.max_seq_len)
        finite = loss_finite and math.isfinite(grad_norm)
        with record_function("step/optimizer"):
            if finite:
                self.optimizer.step()
                self.scheduler.step()
            else:
                self.skipped_steps += 1
            self.nonfinite_in_row = 0 if loss_finite else self.nonfinite_in_row + 1
            if self.scaler is not None:
                self.scaler.update()  # lowers the scale after an overflow (the step above was skipped)
            self.optimizer.zero_grad(set_to_none=True)
        self.step_idx += 1
        with record_function("step/stats"):
            grouped = self._after_step(batch, micro_stats, sizes, aux, finite, grad_norm, lr, t0, t_fetch, tokens,
                                       micros)
        if self.nonfinite_in_row >= self.cfg.max_nonfinite_steps:
            raise diverged_loss(self.step_idx, self.nonfinite_in_row, lr)
        return grouped

    def _after_step(self, batch: Any, micro_stats: list[dict[str, Any]], sizes: list[int], aux: list[Any],
                    finite: bool, grad_norm: float, lr: float, t0: float, t_fetch: float, tokens: int,
                    micros: Sequence[MicroBatch]) -> dict[str, Any]:
        """The step's stats, the objective's after-step hook, the weight push, the checkpoint and the log
        record (or {"train/step"} between logs)."""
        stats = self.objective.step_stats(self, batch, micro_stats, sizes)
        self.objective.after_step(self, stats, aux, finite)
        if self.publisher is not None and self.cfg.sync_every_steps > 0:
            if self.step_idx % self.cfg.sync_every_steps == 0:
                self.push_weights()
        if self.checkpointer is not None:
            saved = self.checkpointer.maybe_save(self.model, self.optimizer, step=self.step_idx,
                                                 state=self._checkpoint_state)
            if saved is not None:
                self._checkpoint_saved()
        if self.step_idx % self.cfg.log_every != 0:
            return {"train/step": self.step_idx}
        stats.update(grad_norm=grad_norm, train_step=self.step_idx, skipped_steps=float(self.skipped_steps),
                     step_skipped=0.0 if finite else 1.0, lr=lr)
        return self._log(stats, t0, t_fetch, tokens, micros)

    def _log(self, stats: dict[str, Any], t0: float, t_fetch: float, tokens: int,
             micros: Sequence[MicroBatch]) -> dict[str, Any]:
        """The step's record with its timings and throughput (module docstring), reduced over ranks when
        configured, grouped and logged."""
        elapsed = time.perf_counter() - t0
        compute = max(elapsed - t_fetch, 1e-9)
        examples = sum(m.size if m.examples is None else m.examples for m in micros)
        stats.update({"perf/step_time_s": elapsed, "perf/batch_time_s": t_fetch, "perf/tokens": float(tokens),
                      "perf/examples": float(examples), "perf/tokens_per_s": tokens / compute,
                      "perf/examples_per_s": examples / compute})
        if self.cfg.profile_memory and self.device.type == "cuda":
            stats["gpu_max_mem_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.cfg.reduce_stats_across_ranks:
            stats = reduce_stats_across_ranks(stats)
            stats["train_step"] = self.step_idx
        grouped = group_log_stats(stats)
        if self.train_logger is not None:
            with contextlib.suppress(Exception):
                self.train_logger.log(self.step_idx, grouped)
        return grouped

    # ----------------------------------------------------------------------------------- publishing
    def push_weights(self) -> None:
        """publisher.publish({name: tensor on runtime_device}, version=step_idx) (`engine.publisher`)."""
        device = torch.device(self.cfg.runtime_device or self.cfg.model_device)
        params = policy_params(self.model, device, self.param_filter)
        if params:
            self.publisher.publish(params, version=self.step_idx)

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Any:
        """Write a checkpoint of the current step: model, optimizer, schedule, loss scale, RNGs and the
        objective's state (`Objective.state`)."""
        if self.checkpointer is None:
            raise ValueError("save_checkpoint needs a checkpoint_config")
        meta, tensors = self._checkpoint_state()
        path = self.checkpointer.save(self.model, self.optimizer, step=self.step_idx, metadata=meta, tensors=tensors)
        self._checkpoint_saved()
        return path

    def _checkpoint_saved(self) -> None:
        """Tell the objective that the checkpoint whose `state()` it gave last is durable (`checkpoint_saved`,
        optional: a pipeline batch source acknowledges the items it covers)."""
        hook = getattr(self.objective, "checkpoint_saved", None)
        if hook is not None:
            hook()

    def _checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(metadata, tensors) of a checkpoint of the current step, besides the model and the optimizer."""
        meta, tensors = self.objective.state()
        meta = {
            **meta,
            "skipped_steps": self.skipped_steps,
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "python_random": random_state(),
            "config": {k: v for k, v in asdict(self.cfg).items() if isinstance(v, (int, float, str, bool, type(None)))},
        }
        return meta, {**rng_tensors(self.device), **tensors}

    def resume(self, resume_from: int | str) -> dict[str, Any]:
        """Load a checkpoint: an int / digit string is a step, an existing path a directory, "latest" the
        newest. Restores everything `save_checkpoint` wrote; returns its trainer state."""
        if self.checkpointer is None:
            raise ValueError("resume needs a checkpoint_config")
        step, path = None, None
        if isinstance(resume_from, int) or (isinstance(resume_from, str) and resume_from.isdigit()):
            step = int(resume_from)
        elif resume_from != "latest":
            path = resume_from
        state = self.checkpointer.load(self.model, self.optimizer, step=step, path=path)
        self.step_idx = int(state["step"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        if "python_random" in state:
            set_random_state(state["python_random"])
        tensors = state.get("tensors", {})
        restore_rng(tensors, self.device)
        self.objective.load_state(state, tensors)
        return state

    # ----------------------------------------------------------------------------------------- loops
    async def eval(self) -> dict[str, float]:
        """Run the evaluator; its metrics become `eval/<k>` plus `eval/step`, logged as a record of their own
        at the current step (train records carry no eval values)."""
        with self._whole_parameters(True):
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
        of that step when checkpointing is on; `stopped_by` then names the signal. A batch source that raises
        `StopRequested` while a batch is fetched (`engine.stop`; the RL objective does when `stop` is requested
        while it refetches empty batches: `stop_signal`) ends it the same way, before that step."""
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        self.stop_signal = stop
        try:
            return await self._train_steps(num_steps, log_fn, stop)
        finally:
            self.stop_signal = None

    async def _train_steps(self, num_steps: int, log_fn: Callable[[dict], None] | None,
                           stop: StopOnSignal | None) -> list[dict[str, Any]]:
        history = []
        if self.cfg.eval_at_start and self.evaluator is not None:
            await self.eval()
        for _ in range(num_steps):
            try:
                stats = await self.train_step()
            except StopRequested:  # the batch source saw the stop while fetching: no step taken
                if stop is None:
                    raise
                self._stop(stop)
                break
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


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # the engine was named Trainer before the RL trainer moved out of it
        warnings.warn("ludic_fast.engine.trainer.Trainer is now Engine (an objective= is required); the RL trainer "
                      "is ludic_fast.trainer.Trainer", DeprecationWarning, stacklevel=2)
        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "is_data_parallel"]
