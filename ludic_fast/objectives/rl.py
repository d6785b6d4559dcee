"""The RL objective (and SFT, an `RLAlgorithm` too: `algorithm.make_sft`) on SAW items from a batch source.

A step: fetch a SAWBatch (async), drop items older than `max_lag` policy versions, run `algo.preprocess`;
refetch while nothing is left. Split the N items by token budget (Ludic's truncate -> sort -> pack) and
collate each chunk with the step's totals (`MacroTotals`, summed over data-parallel ranks), so token_mean /
prompt_mean losses divide by the whole step's counts. A micro-batch's loss is `algo.compute_loss` on the
fused head. Reference model (KL terms): its log-probs of the action tokens go to `batch["ref_logps"]`
through the same head, without gradients; ProRL-style tracking smooths the k3 estimate of KL(behaviour ||
reference) on the sampled tokens, `mean(e^{ref - actor} - (ref - actor) - 1)`, by an exponential moving
average and resets the reference to the policy (`ref <- policy`, "hard", or `ref <- α policy + (1 - α) ref`,
"mix") when it exceeds `kl_target` or the loss's mean entropy falls below `entropy_floor`. Settings: `RLConfig`.
The step's k3 estimate (the mean of the micro-batches' estimates) rides in the first micro-batch (`REF_KL`) into
its loss's stats, so the engine's one read of the step's values reads it too
(`engine.step_parts.read_step_values`); `step_stats` takes it out of the stats again (it is not a loss stat) for
`after_step`.

Temperature: the losses and the reference score with the temperature the rollouts sampled with (each item's
`meta["sampling_temperature"]`, which `rollout.sources.RolloutBatchSource` records), by the one rule of
`ludic_fast._common.logprob_temperature` (greedy 0 scores at 1); items that record none are scored at 1.
`RLConfig.temperature` overrides it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ludic_fast._common import head_temperature, logprob_temperature
from ludic_fast.algorithm import RLAlgorithm
from ludic_fast.data.batching import (
    MacroTotals,
    collate_packed,
    collate_saw_items,
    group_index_of,
    split_items_by_token_budget,
)
from ludic_fast.data.types import SAWBatch, SAWItem
from ludic_fast.distributed.macro import macro_totals_across_ranks
from ludic_fast.engine.config import head_options
from ludic_fast.engine.guard import diverged_sampling, is_sampling_divergence
from ludic_fast.engine.objective import EngineView, MicroBatch
from ludic_fast.engine.stop import StopRequested
from ludic_fast.integrations.transformers import LMHead
from ludic_fast.objectives.logps import action_logps
from ludic_fast.run.stats import Reducer, aggregate_stats
from ludic_fast.token_batch import action_rows

log = logging.getLogger("ludic_fast.trainer")  # the public trainer's logger name

#: batch-meta values logged with the step when the source sets them (and every `episode_*` value: the
#: episode statistics of `ludic_fast.agents.EnvBatchSource`)
_META_KEYS = ("oversampling_factor", "zvp_filter_frac", "rollout_rounds", "zero_variance_group_frac",
              "zero_weight_frac", "empty_batches")
_REF_RESETS = ("hard", "mix")
#: the key of the step's k3 KL estimate (0-d), in its first collated micro-batch and in that one's loss stats
REF_KL = "ref_kl_k3"


@dataclass
class RLConfig:
    """The RL objective's settings (module docstring).

    max_lag: drop items sampled more than this many policy versions before the current step (None: keep all).
    temperature: the head temperature T of the losses and the reference, softmax(z / T); None (default): the
    temperature the rollouts sampled with. kl_target / entropy_floor: reset the reference (needs a ref_model)
    when the smoothed KL exceeds / the mean entropy falls below them; kl_ema_decay: the KL average's decay;
    ref_reset: "hard" (ref <- policy) or "mix" (ref <- α policy + (1 - α) ref, α = ref_mix_alpha).
    """

    max_lag: int | None = None
    temperature: float | None = None
    kl_target: float | None = None
    entropy_floor: float | None = None
    kl_ema_decay: float = 0.9
    ref_reset: str = "hard"
    ref_mix_alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0 or None, got {self.max_lag}")
        if self.temperature is not None:
            self.temperature = head_temperature(self.temperature)
        if self.ref_reset not in _REF_RESETS:
            raise ValueError(f"ref_reset must be one of {_REF_RESETS}, got {self.ref_reset!r}")
        if not 0.0 < self.ref_mix_alpha <= 1.0:
            raise ValueError(f"ref_mix_alpha must lie in (0, 1], got {self.ref_mix_alpha}")
        if not 0.0 <= self.kl_ema_decay < 1.0:
            raise ValueError(f"kl_ema_decay must lie in [0, 1), got {self.kl_ema_decay}")


class RLObjective:
    """`algo` on the batches of `batch_source` (`async next_batch() -> SAWBatch`, optionally `state_dict()` /
    `load_state_dict()` for exact resume and `checkpoint_saved()`, called once that checkpoint is durable);
    `ref_model`: a frozen copy for KL terms and resets; `config`: the
    settings (`RLConfig`, its defaults when None)."""

    def __init__(self, algo: RLAlgorithm, batch_source: Any, *, ref_model: nn.Module | None = None,
                 reducers: Mapping[str, Reducer] | None = None, config: RLConfig | None = None):
        self.config = RLConfig() if config is None else config
        if (self.config.kl_target is not None or self.config.entropy_floor is not None) and ref_model is None:
            raise ValueError("kl_target / entropy_floor reset a reference model: pass ref_model")
        self.algo = algo
        self.name = algo.name
        self.batch_source = batch_source
        self.ref_model = None if ref_model is None else ref_model.eval().requires_grad_(False)
        self.reducers = dict(reducers or {})
        self.ref_resets = 0
        self.kl_ref_ema: float | None = None
        #: the head temperature of the current step (`step_temperature`)
        self.temperature = 1.0 if self.config.temperature is None else self.config.temperature
        self._warned_temperature = False
        #: the step's k3 estimate, as read with the step's values (`step_stats`; None: none)
        self._step_kl: float | None = None
        #: whether next_batch samples from the policy (a rollout source with a sampler): FSDP2 gathers for it
        self.samples_policy = hasattr(batch_source, "sampler")

    def frozen_models(self) -> list[nn.Module]:
        return [] if self.ref_model is None else [self.ref_model]

    def parameters(self) -> list[nn.Parameter]:
        return []

    # ------------------------------------------------------------------------------------------- data
    async def next_batch(self, engine: EngineView) -> SAWBatch:
        """The next batch with items; batches left empty by max_lag or preprocess are skipped, counted in
        `empty_batches` (logged with the step) and reported on stderr at 1, 10, 100, ... in a row. A stop
        requested meanwhile (the engine's `stop_signal`) raises `StopRequested` before the next fetch."""
        empty = 0
        while True:
            stop = getattr(engine, "stop_signal", None)
            if empty and stop is not None and stop.requested:
                raise StopRequested(f"{stop.signal_name} while refetching: {empty} batch(es) in a row were empty")
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
                    raise diverged_sampling(engine.step_idx + 1, engine.optimizer.param_groups[0]["lr"]) from None
                raise
            if self.config.max_lag is not None:
                saw_batch.items = [
                    it
                    for it in saw_batch.items
                    if engine.step_idx - it.meta.get("policy_version", engine.step_idx) <= self.config.max_lag
                ]
            if self.algo.preprocess is not None:
                saw_batch = self.algo.preprocess(saw_batch)
            if saw_batch.items:
                rollout_ids = {it.meta.get("rollout_id") for it in saw_batch.items} - {None}
                saw_batch.meta["effective_rollouts"] = len(rollout_ids) if rollout_ids else len(saw_batch.items)
                saw_batch.meta["empty_batches"] = empty
                return saw_batch
            empty += 1

    def step_temperature(self, items: Sequence[SAWItem]) -> float:
        """The head temperature of a step on `items` (module docstring): `config.temperature` when set, else
        the one temperature the items were sampled with (ValueError when they were sampled at several)."""
        recorded = {logprob_temperature(it.meta.get("sampling_temperature", 1.0), "meta['sampling_temperature']")
                    for it in items}
        if self.config.temperature is not None:
            if recorded - {self.config.temperature} and not self._warned_temperature:
                self._warned_temperature = True
                log.warning("the losses score at temperature %s while the rollouts sampled at %s (an off-policy "
                            "ratio); leave temperature unset to use the sampling temperature",
                            self.config.temperature, sorted(recorded))
            return self.config.temperature
        if len(recorded) > 1:
            raise ValueError(f"the step's items were sampled at several temperatures {sorted(recorded)}: set the "
                             "RL config's temperature to score them at one")
        return recorded.pop() if recorded else 1.0

    def micro_batches(self, engine: EngineView, saw_batch: SAWBatch) -> list[MicroBatch]:
        """Token-budget chunks, collated with the step's totals; replaces `saw_batch.items` by the truncated,
        sorted items and sets the step's temperature. With a reference model each chunk carries `ref_logps` and
        the first one the step's k3 KL estimate (`REF_KL`, module docstring)."""
        cfg = engine.cfg
        chunks = split_items_by_token_budget(
            saw_batch.items, micro_token_budget=cfg.micro_token_budget, max_seq_len=cfg.max_seq_len, layout=cfg.layout
        )
        saw_batch.items = [it for chunk in chunks for it in chunk]
        if not saw_batch.items:
            raise ValueError("no items to train on after preprocessing")
        self.temperature = self.step_temperature(saw_batch.items)
        index, macro = group_index_of(saw_batch.items), MacroTotals.of(saw_batch.items)
        if engine.data_parallel:  # DDP / FSDP1 name their group; FSDP2 uses the default one
            macro = macro_totals_across_ranks(macro, getattr(engine.model, "process_group", None))
        micros, kls = [], []
        for chunk in chunks:
            if cfg.layout == "packed":
                batch = collate_packed(chunk, device=engine.device, group_index=index, macro=macro)
            else:
                batch = collate_saw_items(
                    chunk, pad_token_id=cfg.pad_token_id, device=engine.device, group_index=index, macro=macro
                )
            if self.ref_model is not None:
                batch["ref_logps"] = self.reference_logps(engine, batch)
                if "actor_logps" in batch:
                    kls.append(_k3_on_samples(batch["ref_logps"], batch["actor_logps"], action_rows(batch)))
            micros.append(MicroBatch(batch, len(chunk), examples=len(chunk)))
        if kls:
            micros[0].batch[REF_KL] = torch.stack(kls).mean()
        return micros

    # ------------------------------------------------------------------------------------------- loss
    def loss(self, engine: EngineView, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        def loss(head: LMHead, hidden: Tensor) -> tuple[Tensor, dict[str, Any]]:
            return self.algo.compute_loss(batch, hidden=hidden, **head.kwargs(), temperature=self.temperature,
                                          **head_options(engine.cfg))

        value, stats = engine.head_loss(batch, loss, fp32_head=self.algo.fp32_head)
        if REF_KL in batch:
            stats[REF_KL] = batch[REF_KL]
        return value, stats

    @torch.no_grad()
    def reference_logps(self, engine: EngineView, batch: Mapping[str, Tensor]) -> Tensor:
        """log p_ref of each action token at its position ([B, T], 0 elsewhere), through the fused head at the
        step's temperature."""
        options = {"temperature": self.temperature, **head_options(engine.cfg)}
        return engine.frozen_head(self.ref_model, batch, lambda head, h: action_logps(head, h, batch, **options),
                                  fp32_head=self.algo.fp32_head)

    # ------------------------------------------------------------------------------------------ stats
    def step_stats(self, engine: EngineView, saw_batch: SAWBatch, micro_stats: Sequence[dict[str, Any]],
                   sizes: Sequence[int]) -> dict[str, Any]:
        kl = [s.pop(REF_KL) for s in micro_stats if REF_KL in s]
        self._step_kl = float(kl[0]) if kl else None  # a float already when read with the step's values
        stats = aggregate_stats(micro_stats, [saw_batch], reducers=self.reducers, micro_batch_sizes=list(sizes))
        stats.update({k: float(v) for k, v in saw_batch.meta.items()
                      if k in _META_KEYS or k.startswith(("episode_", "reward/"))})
        return stats

    def after_step(self, engine: EngineView, stats: dict[str, Any], aux: Sequence[Any], finite: bool) -> None:
        """Reference tracking (module docstring) after a finite step; its values join the step's stats."""
        if self.ref_model is None:
            return
        if finite:
            self._track_reference(engine, self._step_kl, stats)
        stats.update(kl_ref_ema=self.kl_ref_ema or 0.0, ref_resets=float(self.ref_resets))

    def _track_reference(self, engine: EngineView, kl: float | None, stats: Mapping[str, float]) -> None:
        cfg = self.config
        if kl is not None:
            d = cfg.kl_ema_decay
            self.kl_ref_ema = kl if self.kl_ref_ema is None else d * self.kl_ref_ema + (1 - d) * kl
        entropy = next((v for k, v in stats.items() if k.endswith("entropy_mean")), None)
        over_kl = cfg.kl_target is not None and self.kl_ref_ema is not None and self.kl_ref_ema > cfg.kl_target
        low_h = cfg.entropy_floor is not None and entropy is not None and entropy < cfg.entropy_floor
        if over_kl or low_h:
            self.reset_reference(engine)

    @torch.no_grad()
    def reset_reference(self, engine: EngineView) -> None:
        """ref <- policy ("hard") or ref <- α policy + (1 - α) ref ("mix"); the KL average restarts."""
        policy = dict(engine.model.named_parameters())
        alpha = 1.0 if self.config.ref_reset == "hard" else self.config.ref_mix_alpha
        for name, ref_p in self.ref_model.named_parameters():
            src = policy.get(name)
            if src is not None and src.shape == ref_p.shape:
                ref_p.mul_(1 - alpha).add_(src.detach().to(ref_p.dtype), alpha=alpha)
        self.ref_resets += 1
        self.kl_ref_ema = None

    # ------------------------------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        meta: dict[str, Any] = {"algorithm": self.algo.name, "ref_resets": self.ref_resets,
                                "kl_ref_ema": self.kl_ref_ema}
        if self.algo.curriculum is not None:
            meta["curriculum"] = self.algo.curriculum.state_dict()
        if hasattr(self.batch_source, "state_dict"):
            meta["batch_source"] = self.batch_source.state_dict()
        tensors = {} if self.ref_model is None else {f"ref.{k}": v for k, v in self.ref_model.state_dict().items()}
        return meta, tensors

    def checkpoint_saved(self) -> None:
        """The checkpoint of the last `state()` is durable: the batch source's `checkpoint_saved()`, if any."""
        if hasattr(self.batch_source, "checkpoint_saved"):
            self.batch_source.checkpoint_saved()

    def load_state(self, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        self.ref_resets = int(meta.get("ref_resets", 0))
        self.kl_ref_ema = meta.get("kl_ref_ema")
        if self.ref_model is not None:
            ref = {k[len("ref."):]: v for k, v in tensors.items() if k.startswith("ref.")}
            if ref:
                self.ref_model.load_state_dict(ref, strict=False)
        if self.algo.curriculum is not None and "curriculum" in meta:
            self.algo.curriculum.load_state_dict(meta["curriculum"])
        if "batch_source" in meta and hasattr(self.batch_source, "load_state_dict"):
            self.batch_source.load_state_dict(meta["batch_source"])


def _k3_on_samples(ref: Tensor, actor: Tensor, rows: Tensor) -> Tensor:
    """mean over the action tokens x[j+1] of the action `rows` j (`token_batch.action_rows`, the tokens the
    losses score) of e^{ref - actor} - (ref - actor) - 1; no host sync."""
    d = (ref - actor).reshape(-1)[rows + 1]
    if d.numel() == 0:
        return torch.zeros((), device=ref.device)
    return (torch.exp(d) - d - 1).mean()


__all__ = ["RLConfig", "RLObjective"]
