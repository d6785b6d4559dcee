"""Write docs/api.md, the API reference, from the public modules' `__all__` (else their public top-level
functions and classes), signatures and the first paragraph of each docstring.

    python tools/gen_api.py            # rewrite docs/api.md
    python tools/gen_api.py --check    # exit 1 when docs/api.md differs from what would be written
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "api.md"

#: (module, one-line role), in reading order
MODULES = [
    ("ludic_fast", "the head op and its conveniences"),
    ("ludic_fast.losses", "every loss, one import: RL, preference, reward model, distillation, loss composition"),
    ("ludic_fast.losses.policy_terms", "policy-loss terms, written once: PPO clip, CISPO, SAPO, KL estimators"),
    ("ludic_fast.losses.preference", "the preference family: its loss-type tables and make_preference_loss"),
    ("ludic_fast.losses.reward", "Bradley-Terry reward-model loss on a scalar value head"),
    ("ludic_fast.ops.divergence", "fused two-head distillation divergences (the op behind losses.linear_divergence)"),
    ("ludic_fast.data.pair_batching", "pair, KTO and completion batches for the offline objectives"),
    ("ludic_fast.offline_trainer", "OfflineTrainer: a thin alias over the engine for the offline objectives"),
    ("ludic_fast.ops.budget", "memory budgets and the element rule of the head's chunks"),
    ("ludic_fast.ops.plan", "the head's device cost model and planner"),
    ("ludic_fast.data.credit", "credit assigners: rollouts to per-sample weights"),
    ("ludic_fast.algorithm", "RLAlgorithm and the presets of `ludic-fast train --preset`"),
    ("ludic_fast.data.batching", "token-budget micro-batching and collation"),
    ("ludic_fast.data.filters", "sample filters and batch preprocessing"),
    ("ludic_fast.data.curriculum", "No-Positive-Resampling"),
    ("ludic_fast.data.types", "data contracts: rollouts, steps, SAW items and batches"),
    ("ludic_fast.data.dict_codec", "the one to_dict / from_dict pair of the data types (JSON / msgpack, never pickle)"),
    ("ludic_fast.trainer", "the bundled trainer: the public names of the one training engine"),
    ("ludic_fast.engine.trainer", "the one training engine, free of any objective"),
    ("ludic_fast.engine.config", "the engine's settings"),
    ("ludic_fast.engine.objective", "the Objective protocol the engine runs and the engine view it reads"),
    ("ludic_fast.engine.publisher", "the weight push to a rollout engine"),
    ("ludic_fast.engine.guard", "the non-finite and empty-batch guards"),
    ("ludic_fast.engine.stop", "stop on SIGINT / SIGTERM after the current step"),
    ("ludic_fast.objectives.rl", "the RL (and SFT) objective and its settings"),
    ("ludic_fast.objectives.logps", "a frozen model's action log-probs"),
    ("ludic_fast.objectives.preference", "the preference objectives (DPO family, KTO)"),
    ("ludic_fast.objectives.reward", "the reward-model objective"),
    ("ludic_fast.objectives.distill", "the distillation objective (off- and on-policy)"),
    ("ludic_fast.objectives.dataset", "what the dataset (offline) objectives share: example stream, token split"),
    ("ludic_fast.engine.memory_estimate", "the peak-memory estimate of a training step"),
    ("ludic_fast.run.checkpoint", "atomic safetensors checkpoints"),
    ("ludic_fast.run.sharded_checkpoint", "sharded (torch.distributed.checkpoint) checkpoints, HF export"),
    ("ludic_fast.run.stats", "training statistics"),
    ("ludic_fast.run.loggers", "training loggers and the curve plot"),
    ("ludic_fast.run.warnings", "warnings for steps that cannot learn"),
    ("ludic_fast.registry", "the Registry type of every extension point (presets, samplers, rewards)"),
    ("ludic_fast.rollout", "rollout samplers, tasks, rewards, batch sources, evaluation"),
    ("ludic_fast.rollout.sampler", "the Sampler protocol, its sampling types and the SAMPLERS registry"),
    ("ludic_fast.rollout.rewards", "reward functions: the REWARD_FUNCS registry, weighted sums"),
    ("ludic_fast.rollout.weight_transfer", "weights to vLLM servers over NCCL through vLLM's weight-transfer API"),
    ("ludic_fast.cli.presets", "the preset records of `ludic-fast train --preset`"),
    ("ludic_fast.cli.run_config", "`ludic-fast train --config FILE` and the config.yaml a run saves"),
    ("ludic_fast.run.record", "run.json: command line, settings, versions, commit, machine"),
    ("ludic_fast.agents", "agents in environments: multi-turn episodes with tools, token-exact"),
    ("ludic_fast.agents.libraries.reasoning_gym", "reasoning-gym datasets as tasks scored by their own score_answer"),
    ("ludic_fast.agents.libraries.textarena", "textarena games as environments (single-player, or a fixed opponent)"),
    ("ludic_fast.agents.libraries.verifiers", "verifiers environments (load_environment() modules), token-exact"),
    ("ludic_fast.agents.libraries.verifiers_v04", "verifiers 0.4 tasksets and envs (verifiers.v1), token-exact"),
    ("ludic_fast.embedded", "the embedded default: tiny model, character tokenizer, addition task"),
    ("ludic_fast.integrations.transformers", "hidden states and head of any transformers causal LM"),
    ("ludic_fast.integrations.packing", "exact packed (padding-free) attention inputs and their probe"),
    ("ludic_fast.integrations.sdpa_varlen", "exact varlen attention without flash-attn: per-sequence SDPA"),
    ("ludic_fast.integrations.body_kernels", "Liger-Kernel body kernels and torch.compile of the decoder"),
    ("ludic_fast.integrations.trl", "TRL: FastGRPOTrainer"),
    ("ludic_fast.integrations.verl", "verl: fused forward and policy losses"),
    ("ludic_fast.integrations.ludic", "Ludic: compute_loss on a Ludic batch"),
    ("ludic_fast.distributed", "vocab-parallel head, data-parallel helpers"),
    ("ludic_fast.distributed.launch", "torchrun launch: process group, wrapping, rank shares, agreed stops"),
    ("ludic_fast.distributed.pipeline", "pipeline RL over Redis"),
    ("ludic_fast.distributed.pipeline_ranks", "the pipeline learner under torchrun: rank 0 reads, broadcasts batches"),
    ("ludic_fast.distributed.publish", "weight publishing over Redis"),
    ("ludic_fast.distributed.versions", "policy versions monotone across a learner resume"),
    ("ludic_fast.reference", "the executable spec: plain PyTorch on materialised logits"),
]


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    para = doc.split("\n\n")[0].strip()
    return " ".join(line.strip() for line in para.splitlines())


def _signature(obj: object) -> str:
    """inspect's signature with string annotations unquoted ('Tensor' -> Tensor) and default values that
    print a memory address ('<function f at 0x7f...>') shown by name, so the output is the same every run."""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    sig = re.sub(r"ForwardRef\('([^']*)'\)", r"\1", sig)
    sig = re.sub(r"<(?:function|built-in function) ([\w.]+)(?: at 0x[0-9a-f]+)?>", r"\1", sig)
    sig = re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"<\1 object>", sig)
    return re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)


def _public_names(module: object) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, v in vars(module).items()
            if not n.startswith("_")
            and (inspect.isfunction(v) or inspect.isclass(v))
            and getattr(v, "__module__", None) == module.__name__
        ]
    return sorted(n for n in names if not n.startswith("__"))


def _entry(modname: str, name: str, obj: object) -> list[str]:
    if inspect.ismodule(obj):
        return [f"- **`{modname}.{name}`** (module): {_summary(obj)}"]
    if inspect.isclass(obj):
        lines = [f"- **class `{name}{_signature(obj)}`**", f"  {_summary(obj)}".rstrip()]
        for meth, fn in vars(obj).items():
            if meth.startswith("_") or not (inspect.isfunction(fn) or isinstance(fn, (classmethod, staticmethod))):
                continue
            fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
            summary = _summary(fn)
            lines.append(f"  - `.{meth}{_signature(fn)}`" + (f": {summary}" if summary else ""))
        return lines
    if callable(obj):
        return [f"- **`{name}{_signature(obj)}`**", f"  {_summary(obj)}".rstrip()]
    return [f"- `{name}` = `{obj!r}`" if isinstance(obj, (int, float, str)) else f"- `{name}`"]


def render() -> str:
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python tools/gen_api.py` (`make docs`); each entry is the signature",
        "and the first paragraph of its docstring. The module docstrings (`help(module)`) hold the math.",
        "",
    ]
    for modname, role in MODULES:
        try:
            module = importlib.import_module(modname)
        except ImportError as exc:  # an optional dependency is missing in this environment
            out += [f"## `{modname}`", "", f"{role}. (Not importable here: {exc}.)", ""]
            continue
        out += [f"## `{modname}`", "", f"{role}. {_summary(module)}", ""]
        for name in _public_names(module):
            out += _entry(modname, name, getattr(module, name))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    from _docgen import write_or_check  # tools/ is on sys.path when this file runs as a script

    return write_or_check(OUT, render, argv, description=__doc__, script="tools/gen_api.py")


if __name__ == "__main__":
    raise SystemExit(main())
