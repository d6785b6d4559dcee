"""How each preset of `ludic-fast train` builds what it trains from the parsed flags: the RL presets' algorithm
(`ludic_fast.algorithm`'s factories) and the offline presets' objectives (preference, KTO, reward model,
distillation). The preset records (`cli/presets.py`) point at these functions."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ludic_fast import algorithm
from ludic_fast.cli.validation import UsageError
from ludic_fast.losses import CPO_LOSS_TYPES, DPO_LOSS_TYPES, CPOLoss, make_preference_loss
from ludic_fast.objectives.distill import DistillObjective
from ludic_fast.objectives.preference import PreferenceObjective
from ludic_fast.objectives.reward import RewardObjective
from ludic_fast.ops import linear_cross_entropy


@dataclass
class BuildInputs:
    """What an offline preset's objective is built on: the policy model, the tokenizer and the encoded
    examples (an RL preset's algorithm needs none of them)."""

    model: torch.nn.Module | None = None
    tokenizer: Any = None
    examples: list[Any] = field(default_factory=list)


def rl_algorithm(factory: Callable[..., algorithm.RLAlgorithm], grouped: bool
                 ) -> Callable[[argparse.Namespace, BuildInputs], algorithm.RLAlgorithm]:
    """An RL preset's build: `factory(group_size=--group-size)` for a group-based preset, else `factory()`."""

    def build(args: argparse.Namespace, inputs: BuildInputs) -> algorithm.RLAlgorithm:
        return factory(group_size=args.group_size) if grouped else factory()

    return build


def preference_loss(loss_cls: type) -> Callable[[argparse.Namespace], Any]:
    """The preset's preference loss from the flags: `loss_cls(beta=--beta, entropy_stats=--entropy-stats)` (each
    when given); for dpo and cpo with `--loss-type` the loss that names (module functions below)."""

    def build(args: argparse.Namespace) -> Any:
        options = {} if args.beta is None else {"beta": args.beta}
        if getattr(args, "entropy_stats", False):
            options["entropy_stats"] = True
        loss_type, weights = getattr(args, "loss_type", None), getattr(args, "loss_weights", None)
        if loss_type is None:
            if weights is not None:
                raise UsageError("--loss-weights needs --loss-type (the loss types they weigh)")
            return loss_cls(**options)
        if loss_cls is CPOLoss:
            return _cpo_loss(loss_type, options)
        return _dpo_loss(loss_type, weights, options)

    return build


def _dpo_loss(loss_type: list[str], weights: list[float] | None, options: dict[str, Any]) -> Any:
    """dpo with --loss-type: `make_preference_loss(--loss-type, weights=--loss-weights)`, DPO loss types only."""
    unknown = [n for n in loss_type if n not in DPO_LOSS_TYPES]
    if unknown:
        raise UsageError(f"--loss-type {unknown[0]}: not a DPO loss type (one of {', '.join(DPO_LOSS_TYPES)})")
    try:
        return make_preference_loss(loss_type, weights=weights, **options)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--loss-type/--loss-weights: {exc}") from None


def _cpo_loss(loss_type: list[str], options: dict[str, Any]) -> CPOLoss:
    """cpo with --loss-type: one of CPO's types (TRL's CPOTrainer loss_type; --loss-weights is dpo's only)."""
    if len(loss_type) != 1 or loss_type[0] not in CPO_LOSS_TYPES:
        raise UsageError(f"--loss-type {','.join(loss_type)}: cpo takes one of {', '.join(CPO_LOSS_TYPES)}")
    return CPOLoss(loss_type=loss_type[0], **options)


def preference_objective(loss_cls: type) -> Callable[[argparse.Namespace, BuildInputs], PreferenceObjective]:
    """A pair (or KTO) preset's objective: its loss, against a frozen copy of the initial model when the loss
    uses a reference."""
    make_loss = preference_loss(loss_cls)

    def build(args: argparse.Namespace, inputs: BuildInputs) -> PreferenceObjective:
        loss_fn = make_loss(args)
        ref = copy.deepcopy(inputs.model).eval().requires_grad_(False) if loss_fn.uses_reference else None
        return PreferenceObjective(loss_fn, ref)

    return build


def reward_objective(args: argparse.Namespace, inputs: BuildInputs) -> RewardObjective:
    """The reward model: the backbone and a scalar value head (Bradley-Terry)."""
    return RewardObjective(torch.nn.Linear(inputs.model.config.hidden_size, 1))


def distill_objective(args: argparse.Namespace, inputs: BuildInputs) -> DistillObjective:
    """Distillation against `--teacher` ('embedded': `embedded_teacher`), `--distill-kind` etc."""
    tok = inputs.tokenizer
    if args.teacher == "embedded":
        teacher = embedded_teacher(args, tok, inputs.examples)
    else:
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
        teacher.requires_grad_(False)
    return DistillObjective(teacher, kind=args.distill_kind, beta=args.distill_beta,
                            temperature=args.distill_temperature, hard_weight=args.hard_weight,
                            on_policy_fraction=args.on_policy_fraction, max_new_tokens=args.max_new_tokens,
                            eos_token_id=tok.eos_token_id, seed=args.seed)


def embedded_teacher(args: argparse.Namespace, tok: Any, examples: list[Any]) -> torch.nn.Module:
    """A tiny Llama of hidden size 96 fitted to the completions by `--teacher-steps` steps of CE."""
    from ludic_fast.data.pair_batching import collate_completions
    from ludic_fast.embedded import build_tiny_model

    teacher = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                               bos_token_id=tok.bos_token_id, seed=args.seed + 1, hidden_size=96,
                               intermediate_size=192)
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(args.teacher_steps):
        idx = torch.randint(0, len(examples), (32,), generator=gen).tolist()
        b = collate_completions(*zip(*[examples[i] for i in idx]), pad_token_id=tok.pad_token_id)
        h = teacher.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
        tgt = torch.where(b["action_mask"][:, 1:] > 0, b["input_ids"][:, 1:], -100)
        linear_cross_entropy(h[:, :-1], teacher.lm_head.weight, tgt).backward()
        opt.step()
        opt.zero_grad()
    teacher.eval().requires_grad_(False)
    return teacher


__all__ = ["BuildInputs", "rl_algorithm", "preference_loss", "preference_objective", "reward_objective",
           "distill_objective", "embedded_teacher"]
