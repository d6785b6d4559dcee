"""`ludic-fast train --preset NAME` for the offline presets (the records of `cli/presets.py` whose kind is not
rl: preference pairs, KTO, reward model, distillation): objectives on a fixed dataset, no rollouts.

Data: `--pref-data` JSONL in the preset's format (`ludic_fast.data.preference_data`), else the embedded rows
built from the addition task. Model: `--model` ('embedded': the tiny Llama, random init). dpo, ipo and kto
train against a frozen copy of the initial model as the reference; reward trains the backbone and a
scalar value head with the Bradley-Terry loss; distill trains the model against `--teacher` ('embedded': a
smaller-width tiny Llama first fitted to the completions for `--teacher-steps` steps of cross-entropy, so
the two heads differ in hidden size) with `linear_divergence`, off-policy on the dataset or GKD-style
on-policy with `--on-policy-fraction`.

Outputs under --output-dir: config.yaml and run.json (`ludic_fast/cli/run_config.py`), metrics.jsonl (phase =
the preset), curves.png (the preset's metric and the loss), summary.json (the metric's first/last-10 means),
model/ (the trained model and tokenizer, save_pretrained; reward adds model/value_head.safetensors),
checkpoints under <preset>/ when `--checkpoint-every` > 0; `--resume` continues from the latest of them
(metrics.jsonl keeps the records up to its step; without a checkpoint there it is an error). The first SIGINT
/ SIGTERM finishes the current step, checkpoints (when on), writes everything above and exits 130 / 143
(`ludic-fast train`). The metric (each record's `metric`): rewards_accuracy for the pair presets and reward,
the rewards margin (chosen - rejected) for kto, the loss for distill.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ludic_fast.cli import parallel, run_setup
from ludic_fast.cli.preset_builders import BuildInputs, preference_loss
from ludic_fast.cli.presets import PRESETS, preset_names
from ludic_fast.cli.recipe import apply_recipe
from ludic_fast.cli.run_config import record_run
from ludic_fast.cli.validation import UsageError, as_flags, check_args, check_device, check_output_dir, comma_numbers
from ludic_fast.data.preference_data import embedded_rows, encode_rows, read_rows
from ludic_fast.engine.config import EngineConfig
from ludic_fast.engine.guard import NonFiniteError
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.engine.trainer import Engine
from ludic_fast.objectives.reward import RewardObjective
from ludic_fast.rollout import resolve_chat_template
from ludic_fast.run.checkpoint import CheckpointManager
from ludic_fast.run.loggers import JSONLLogger, TeeLogger, WandbLogger, keep_records_for_resume, plot_curves, read_jsonl
from ludic_fast.run.sharded_checkpoint import export_hf

#: the offline presets and, by name, their data format, preference loss class, headline metric and unit of data
OFFLINE_PRESETS = preset_names(offline=True)
FORMAT = {p.name: p.data for p in PRESETS if p.offline}
LOSSES = {p.name: p.loss for p in PRESETS if p.loss is not None}
METRIC = {p.name: p.metric for p in PRESETS if p.offline}
UNIT = {p.data: p.unit for p in PRESETS if p.offline}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The offline presets' flags (a group of `ludic-fast train`)."""
    g = p.add_argument_group(f"offline presets ({', '.join(OFFLINE_PRESETS)})")
    g.add_argument("--offline-steps", type=int, default=100, help="optimizer steps of an offline preset")
    g.add_argument("--pref-data", default=None, help="JSONL in the preset's format (default: embedded rows)")
    g.add_argument("--pref-batch-size", type=int, default=16, help="pairs / examples per step")
    g.add_argument("--beta", type=float, default=None, help="the loss's β (default: its paper's)")
    g.add_argument("--teacher", default="embedded", help="distill: 'embedded' or a HF causal LM name/path")
    g.add_argument("--teacher-steps", type=int, default=60, help="distill: CE steps fitting the embedded teacher")
    g.add_argument("--distill-kind", default="forward_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    g.add_argument("--distill-beta", type=float, default=0.5, help="distill: JSD mixture β")
    g.add_argument("--distill-temperature", type=float, default=1.0)
    g.add_argument("--hard-weight", type=float, default=0.0, help="distill: weight of the hard-label CE")
    g.add_argument("--on-policy-fraction", type=float, default=0.0, help="distill: GKD λ (student samples)")
    g.add_argument("--loss-type", type=_names, default=None,
                   help="dpo: TRL's DPO loss type(s), comma-separated to combine (e.g. sigmoid,sft = RPO); "
                        "cpo: one of CPO's (sigmoid, hinge, ipo, simpo); default sigmoid")
    g.add_argument("--loss-weights", type=comma_numbers, default=None,
                   help="dpo: one weight per --loss-type, comma-separated (default: 1 each)")
    g.add_argument("--entropy-stats", action="store_true",
                   help="dpo, ipo, simpo, orpo, cpo: also log the policy's mean entropy per side "
                        "(train/entropy_chosen, train/entropy_rejected)")


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _loss(args: argparse.Namespace) -> Any:
    """The preference loss `--preset` builds from the flags (`cli.preset_builders.preference_loss`)."""
    return preference_loss(LOSSES[args.preset])(args)


def _examples(args: argparse.Namespace, tok: Any, chat: bool) -> list[Any]:
    fmt = FORMAT[args.preset]
    try:
        rows = read_rows(args.pref_data, fmt) if args.pref_data else embedded_rows(fmt, 64, args.seed)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--pref-data: {exc}") from None
    return encode_rows(rows, fmt, tok, chat_template=chat)


def _check(args: argparse.Namespace, command: str) -> None:
    if command != "train":
        raise UsageError(f"--preset {args.preset} runs under `ludic-fast train`")
    if args.resume and args.output_dir is None:
        raise UsageError("--resume needs --output-dir (the run to continue)")
    if args.distill_kind == "jsd" and not 0 < args.distill_beta < 1:
        raise UsageError("--distill-beta must lie in (0, 1) for --distill-kind jsd")
    check_device(args.device)
    apply_recipe(args)  # resolves --attn and --dtype
    check_args(args)
    PRESETS[args.preset].check(args)
    try:  # the engine's own cross-field checks, before anything runs
        engine_config(args, 0)
    except ValueError as exc:
        raise UsageError(as_flags(str(exc), args)) from None


def main(args: argparse.Namespace, command: str, stop: StopOnSignal | None = None, *,
         argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Run an offline preset (module docstring); 2 after a one-line error for a bad input, 130 / 143 when
    stopped by SIGINT / SIGTERM through `stop`. `argv` (the command line after `ludic-fast`) and `parser`
    (`ludic-fast train`'s) go to the run record."""
    t0 = time.perf_counter()
    stop = stop or StopOnSignal()
    try:
        _check(args, command)
        tok = run_setup.build_tokenizer(args)
        chat = resolve_chat_template(tok, args.chat_template)
        examples = _examples(args, tok, chat)
        args.output_dir = args.output_dir or run_setup.default_output_dir(args, command)
        out = check_output_dir(args.output_dir, "--output-dir")
        resume_step = run_setup.check_resume(args, (args.preset,))
    except (UsageError, ValueError) as exc:
        print(f"ludic-fast {command}: error: {exc}", file=sys.stderr)
        return 2
    preset = PRESETS[args.preset]
    main_rank = parallel.is_main(args)  # rank 0 writes the run directory
    if main_rank:
        record_run(out, parser, args, argv, trainer_configs={args.preset: engine_config(args, tok)},
                   objective=_loss(args) if preset.loss else {f: getattr(args, f) for f in preset.flags})
    metrics = out / "metrics.jsonl"
    ckpt = run_setup.checkpoint_config(args, args.preset)
    resume = resume_step is not None
    if main_rank:  # the records of steps after the checkpoint are trained again
        keep_records_for_resume(metrics, phases=(args.preset,), resumed=args.preset if resume else None,
                                step=resume_step)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = run_setup.build_model_and_tokenizer(args, tok)
    model.to(args.device)
    objective = PRESETS[args.preset].build(args, BuildInputs(model, tok, examples))
    objective.use_examples(examples, batch_size=args.pref_batch_size, seed=args.seed)
    objective.shard(getattr(args, "rank", 0), getattr(args, "world_size", 1))
    model = parallel.wrap(args, model, find_unused_parameters=args.preset == "reward")  # reward skips the LM head
    if main_rank:
        print(f"ludic-fast {command}: {args.offline_steps} steps of {args.preset} on {len(examples)} "
              f"{UNIT[FORMAT[args.preset]]} ({args.pref_data or 'embedded'}); output {out}", flush=True)
    console = run_setup.build_console_logger(args.logger if main_rank else "none")
    wandb = WandbLogger(config=vars(args)) if args.wandb and main_rank else None
    logger = TeeLogger(JSONLLogger(metrics, extra={"phase": args.preset}), console, wandb) if main_rank else None
    error = None
    try:
        trainer = Engine(model=model, objective=objective, cfg=engine_config(args, tok), checkpoint_config=ckpt,
                         resume_from="latest" if resume else None, train_logger=logger,
                         lora_config=run_setup.lora_config(args))
        if main_rank:
            print(f"{args.preset}: {trainer.memory_estimate.format()}", flush=True)
        if resume and main_rank:
            print(f"ludic-fast {command}: resumed at step {trainer.step_idx}", flush=True)
        trainer.train_sync(max(0, args.offline_steps - trainer.step_idx), stop=stop)
    except NonFiniteError as exc:
        error = exc
    finally:
        run_setup.close_loggers(console, wandb)
    stopped = stop.requested  # read once here by every rank (under --parallel a collective)
    if error is not None:
        if main_rank:
            print(f"ludic-fast {command}: error: {error} (kept: {metrics}, earlier checkpoints)", file=sys.stderr)
        return 1
    save_trained(out / "model", trainer.model, tok, objective, parallel=getattr(args, "parallel", None) is not None)
    if not main_rank:
        return stop.exit_code if stopped else 0
    records = read_jsonl(metrics) if metrics.exists() else []
    summary = summarize(records, METRIC[args.preset])
    summary.update(wall_time_s=time.perf_counter() - t0, skipped_steps=trainer.skipped_steps)
    if not args.no_plot and importlib.util.find_spec("matplotlib") is not None:
        summary["png"] = str(plot_curves(records, out / "curves.png", reward_key=METRIC[args.preset],
                                         title=f"ludic-fast train: {args.preset}", no_reward_phases=()))
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if stopped:
        saved = ["metrics.jsonl", "summary.json", "model/"] + (["curves.png"] if "png" in summary else [])
        ckpt_dir = None if args.checkpoint_every <= 0 else CheckpointManager(ckpt).resolve()
        line = run_setup.stopped_line(command, stop, args.preset, trainer.step_idx, ckpt_dir, saved)
        print(line, file=sys.stderr, flush=True)
        return stop.exit_code
    print(f"\n{args.preset}: {summary['metric']} first-{summary['n']} mean {summary['first']:.4f}, last-"
          f"{summary['n']} mean {summary['last']:.4f}; {summary['wall_time_s']:.0f} s")
    return 0


def engine_config(args: argparse.Namespace, tok: Any) -> EngineConfig:
    """The engine's settings of the trainer flags for an offline preset (`--offline-steps` optimizer steps)."""
    return run_setup.trainer_config(args, tok, lr=args.lr, steps=args.offline_steps, sync=0)


def save_trained(path: Path, model: torch.nn.Module, tok: Any, objective: Any, *, parallel: bool = False) -> None:
    """The trained model and tokenizer (`save_pretrained`, safetensors; under LoRA the adapter alone,
    adapter_model.safetensors + adapter_config.json); for reward also the value head
    (`value_head.safetensors`: weight [1, D], bias [1]). parallel: the model is DDP / FSDP2 on every rank, which
    all call this (`run.sharded_checkpoint.export_hf` gathers it); rank 0 writes."""
    from safetensors.torch import save_file

    if not torch.cuda.is_available():  # accelerate's unwrap imports DeepSpeed when installed: name its accelerator,
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else its probe warns "Setting accelerator to CPU"
    if parallel:
        if export_hf(model, path, tok) is None:
            return
    else:
        model.save_pretrained(path)
        tok.save_pretrained(path)
    if isinstance(objective, RewardObjective):
        head = objective.value_head
        save_file({"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()},
                  str(path / "value_head.safetensors"))


def summarize(records: list[dict[str, float]], key: str) -> dict[str, Any]:
    """The metric's curve and the means of its first and last n = min(10, steps // 2) steps (n >= 1)."""
    curve = [r[key] for r in records]
    n = max(1, min(10, len(curve) // 2))
    return {"metric": key, "curve": curve, "n": n, "first": sum(curve[:n]) / n, "last": sum(curve[-n:]) / n}


__all__ = ["OFFLINE_PRESETS", "add_arguments", "main", "summarize"]
