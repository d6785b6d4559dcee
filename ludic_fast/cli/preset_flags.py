"""Which `ludic-fast train` flags apply to which preset: a flag given on the command line that the chosen
preset cannot use is a one-line error before anything runs, never silently ignored.

The trainer flags (precision, schedule, LoRA, layout, token budget, memory budget, body kernels, compile,
checkpoints, logging) apply to every preset; the rollout and SFT warm-up flags only to the RL presets; the
offline flags only to the offline presets, and some only to one of them.
"""

from __future__ import annotations

import argparse

from ludic_fast.cli.validation import UsageError

#: flags of the RL presets (rollouts, the SFT warm-up, evaluation on a task)
RL_ONLY = ("task", "eval_task", "eval_holdout", "eval_on_train", "reward", "sft_steps", "sft_batch_size", "sft_lr",
           "sft_data", "rl_steps", "prompts_per_batch", "group_size", "temperature", "dynamic_sampling",
           "max_rounds", "tie_jitter", "engine", "vllm_arg", "vllm_url", "max_lag", "eval_every")
#: flags of the offline presets, and the presets (of those) that read them
OFFLINE_ONLY = {
    "offline_steps": None,
    "pref_data": None,
    "pref_batch_size": None,
    "beta": ("dpo", "ipo", "simpo", "orpo", "cpo", "kto"),
    "teacher": ("distill",),
    "teacher_steps": ("distill",),
    "distill_kind": ("distill",),
    "distill_beta": ("distill",),
    "distill_temperature": ("distill",),
    "hard_weight": ("distill",),
    "on_policy_fraction": ("distill",),
    "loss_type": ("dpo", "cpo"),
    "loss_weights": ("dpo",),
    "entropy_stats": ("dpo", "ipo", "simpo", "orpo", "cpo"),
}
#: flags read by some offline presets: max-new-tokens (on-policy distillation samples); backend (the presets
#: whose loss runs the LM head: not reward, whose value head scores the hidden states)
OFFLINE_USES = {"max_new_tokens": ("distill",), "backend": ("dpo", "ipo", "simpo", "orpo", "cpo", "kto", "distill")}


def _given(parser: argparse.ArgumentParser, args: argparse.Namespace, dest: str) -> bool:
    return hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flag_scope(parser: argparse.ArgumentParser, args: argparse.Namespace, offline_presets: tuple[str, ...]
                     ) -> None:
    """UsageError for the first flag given on the command line that `args.preset` cannot use (call it on the
    parsed flags, before the recipe fills in its defaults)."""
    preset = args.preset
    if preset in offline_presets:
        unusable = [d for d in RL_ONLY if _given(parser, args, d)]
        unusable += [d for d, only in OFFLINE_ONLY.items() if only and preset not in only and _given(parser, args, d)]
        unusable += [d for d, users in OFFLINE_USES.items() if preset not in users and _given(parser, args, d)]
    else:
        unusable = [d for d in OFFLINE_ONLY if _given(parser, args, d)]
    if unusable:
        kind = "an offline preset" if preset in offline_presets else "an RL preset"
        raise UsageError(f"{_flag(unusable[0])} does not apply to --preset {preset} ({kind}): drop it")


__all__ = ["RL_ONLY", "OFFLINE_ONLY", "OFFLINE_USES", "check_flag_scope"]
