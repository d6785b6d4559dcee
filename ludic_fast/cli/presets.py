"""The presets of `ludic-fast train --preset`, one record each: the only place a preset's name is written.

A record says what the preset is (`kind`: rl, preference, reward, distill), how it builds what it trains
from the parsed flags (`build(args, inputs)`: an `RLAlgorithm` for an RL preset, the `Objective` of an
offline one), the data it reads, the flags it reads beyond the trainer flags every preset reads, its
headline metric and one line of help. The CLI's `--preset` choices, its `--help`, the flag-scope check
(`cli/preset_flags.py`), the dataset presets' dispatch (`cli/dataset_presets.py`) and the docs' preset tables
(`tools/gen_registry_docs.py`) are derived from these records.

Adding a preset: its loss / algorithm where losses live, then one `PRESETS.add(Preset(...))` here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ludic_fast import algorithm as rl
from ludic_fast.cli.preset_builders import (
    BuildInputs,
    distill_objective,
    preference_loss,
    preference_objective,
    reward_objective,
    rl_algorithm,
)
from ludic_fast.losses import CPOLoss, DPOLoss, IPOLoss, KTOLoss, ORPOLoss, SimPOLoss
from ludic_fast.registry import Registry

KINDS = ("rl", "preference", "reward", "distill")


@dataclass(frozen=True)
class Preset:
    """One preset (module docstring). `data`: "groups" (RL rollouts in groups of --group-size), "rollouts"
    (RL, one per prompt), or an offline JSONL format of `ludic_fast.data.preference_data` ("pairs", "kto",
    "completions"); `unit`: what one example of that data is called; `flags`: argparse dest names of the flags
    it reads beyond `TRAINER_FLAGS`; `metric`: the logged key its summary reports; `loss`: the preference loss
    class of a pair / KTO preset (its `--beta`, `--loss-type` ... build it)."""

    name: str
    kind: str
    help: str
    build: Callable[[argparse.Namespace, BuildInputs], Any]
    data: str
    unit: str
    metric: str
    flags: tuple[str, ...]
    loss: type | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def offline(self) -> bool:
        """Trains on a fixed dataset (no rollouts)."""
        return self.kind != "rl"

    def check(self, args: argparse.Namespace) -> None:
        """The preset's own flag checks before anything is built (UsageError): its loss from the flags."""
        if self.loss is not None:
            preference_loss(self.loss)(args)


#: flags every preset reads: model and tokenizer, device, the trainer, precision and kernels, logging, output
TRAINER_FLAGS = ("config", "model", "tokenizer", "chat_template", "device", "seed", "threads", "preset", "lr",
                 "weight_decay", "lr_scheduler", "warmup_steps", "max_grad_norm", "max_seq_len", "micro_token_budget",
                 "gradient_checkpointing", "memory_budget", "lora_r", "output_dir", "checkpoint_every",
                 "max_to_keep", "resume", "logger", "wandb", "no_plot", "profile", "dtype", "attn", "layout",
                 "body_kernels", "compile_body", "parallel")
#: flags of the RL presets: the task, rewards, the SFT warm-up, rollouts and their sampler, evaluation
RL_FLAGS = ("task", "task_arg", "eval_task", "eval_holdout", "eval_on_train", "reward", "reward_weights", "sft_steps",
            "sft_batch_size", "sft_lr", "sft_data", "rl_steps", "prompts_per_batch", "group_size", "temperature",
            "max_new_tokens", "dynamic_sampling", "max_rounds", "tie_jitter", "engine", "vllm_arg", "vllm_url",
            "max_lag", "eval_every", "backend", "env", "env_arg", "env_reward", "max_turns", "max_episode_tokens",
            "env_timeout", "tool_timeout", "format_penalty", "episode_items", "episode_log", "demonstrations")
#: flags of every offline preset
DATA_FLAGS = ("offline_steps", "pref_data", "pref_batch_size")
DISTILL_FLAGS = ("teacher", "teacher_steps", "distill_kind", "distill_beta", "distill_temperature", "hard_weight",
                 "on_policy_fraction", "max_new_tokens")

PRESETS: Registry[Preset] = Registry("preset")


def _rl(name: str, factory: Callable[..., rl.RLAlgorithm], grouped: bool, help: str) -> None:
    PRESETS.add(Preset(name, "rl", help, rl_algorithm(factory, grouped), "groups" if grouped else "rollouts",
                       "rollouts", "train/avg_total_reward", RL_FLAGS))


_rl("reinforce", rl.make_reinforce, False, "REINFORCE, Monte-Carlo return")
_rl("reinforce_baseline", rl.make_reinforce_baseline, False, "REINFORCE with a micro-batch mean baseline")
_rl("grpo", rl.make_grpo, True, "GRPO (Shao et al. 2024): group-normalised advantage, token-clipped ratio")
_rl("dr_grpo", rl.make_dr_grpo, True, "Dr. GRPO (Liu et al. 2025): no std normalisation, constant divisor")
_rl("dapo", rl.make_dapo, True, "DAPO (Yu et al. 2025): clip-higher, token mean, dynamic sampling on")
_rl("gspo", rl.make_gspo, True, "GSPO (Zheng et al. 2025): sequence-level ratio")
_rl("cispo", rl.make_cispo, True, "CISPO (MiniMax-M1 2025): clipped importance weight, stop-gradient")
_rl("scalerl", rl.make_scalerl, True, "ScaleRL (Khatri et al. 2025): CISPO-style cap, prompt mean, fp32 head")
_rl("rl_zvp", rl.make_rl_zvp, True, "RL-ZVP (arXiv 2509.21880): CISPO, entropy-shaped advantage on tied groups")

_PAIR = DATA_FLAGS + ("beta", "backend")
_ACCURACY = "train/rewards_accuracy"


def _pair(name: str, loss: type, help: str, extra: tuple[str, ...] = ("entropy_stats",)) -> None:
    PRESETS.add(Preset(name, "preference", help, preference_objective(loss), "pairs", "preference pairs", _ACCURACY,
                       _PAIR + extra, loss=loss))


_pair("dpo", DPOLoss, "DPO (Rafailov et al. 2023); --loss-type: TRL's DPO loss types, combinable",
      ("loss_type", "loss_weights", "entropy_stats"))
_pair("ipo", IPOLoss, "IPO (Azar et al. 2023): squared margin around 1/(2 beta)")
_pair("simpo", SimPOLoss, "SimPO (Meng et al. 2024): length-normalised, reference-free, target margin")
_pair("orpo", ORPOLoss, "ORPO (Hong et al. 2024): NLL plus an odds-ratio term, reference-free")
_pair("cpo", CPOLoss, "CPO (Xu et al. 2024): NLL plus a reference-free pair loss; --loss-type: CPO's",
      ("loss_type", "entropy_stats"))
PRESETS.add(Preset("kto", "preference", "KTO (Ethayarajh et al. 2024): unpaired desirable / undesirable completions",
                   preference_objective(KTOLoss), "kto", "labelled completions", "train/rewards_margin", _PAIR,
                   loss=KTOLoss))
PRESETS.add(Preset("reward", "reward", "reward model: backbone + scalar value head, Bradley-Terry loss",
                   reward_objective, "pairs", "preference pairs", _ACCURACY, DATA_FLAGS))
PRESETS.add(Preset("distill", "distill", "distillation from --teacher: forward / reverse KL or JSD, GKD on-policy",
                   distill_objective, "completions", "completions", "train/loss",
                   DATA_FLAGS + DISTILL_FLAGS + ("backend",)))


def preset_names(kind: str | None = None, *, offline: bool | None = None) -> tuple[str, ...]:
    """The registered preset names, of one kind or only the offline / RL ones when asked."""
    return tuple(p.name for p in PRESETS
                 if (kind is None or p.kind == kind) and (offline is None or p.offline == offline))


def presets_epilog() -> str:
    """The `--help` listing of every preset: name, kind, data and its line of help."""
    width = max(len(p.name) for p in PRESETS)
    rows = [f"  {p.name:<{width}}  {p.kind:<10}  {p.data:<11}  {p.help}" for p in PRESETS]
    return "presets (--preset NAME; kind, data, what it trains):\n" + "\n".join(rows)


__all__ = ["Preset", "PRESETS", "KINDS", "TRAINER_FLAGS", "RL_FLAGS", "DATA_FLAGS", "DISTILL_FLAGS", "preset_names",
           "presets_epilog"]
