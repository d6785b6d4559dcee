"""`ludic-fast train`'s two phases: the SFT warm-up (masked CE on the task's answers or --sft-data) and RL
(the preset's algorithm on rollouts of --sampler, evaluated every --eval-every steps), and what RL samples with."""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ludic_fast import algorithm as presets
from ludic_fast.cli import env_train
from ludic_fast.cli.preset_builders import BuildInputs
from ludic_fast.cli.presets import PRESETS as PRESET_RECORDS
from ludic_fast.cli.run_setup import build_model_and_tokenizer, checkpoint_config, lora_config, trainer_config
from ludic_fast.distributed.launch import EngineVersion, RankShareSource, unwrap
from ludic_fast.engine.stop import StopOnSignal
from ludic_fast.rollout import (
    DatasetBatchSource,
    Evaluator,
    PromptAnswerTask,
    RolloutBatchSource,
    SamplingConfig,
    resolve_chat_template,
    sft_item,
)
from ludic_fast.rollout.sampler import SAMPLERS, Sampler, SamplerSettings
from ludic_fast.run.checkpoint import CheckpointManager
from ludic_fast.run.stats import default_reducers
from ludic_fast.trainer import Trainer


def build_engine(args: argparse.Namespace, model: torch.nn.Module, tok: Any) -> Sampler:
    """The rollout sampler of --sampler (`rollout.sampler.SAMPLERS`): transformers `generate` on the trainer's
    model, vLLM (in this process, or its server: started here, or --vllm-url's) serving --model (the embedded
    model: a copy saved under --output-dir) in --dtype with the --vllm-arg engine arguments, or a user's."""
    settings = SamplerSettings(model=unwrap(model), tokenizer=tok, seed=args.seed, dtype=VLLM_DTYPES[args.dtype],
                               model_path=lambda: vllm_model_dir(args, tok), tokenizer_path=args.tokenizer,
                               options=dict(args.vllm_arg), url=args.vllm_url)
    return SAMPLERS.resolve(args.engine).build(settings)


build_sampler = build_engine



#: vLLM's dtype names of the resolved --dtype
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_model_dir(args: argparse.Namespace, tok: Any) -> str:
    """--model; for the embedded model, its architecture and tokenizer saved to <output-dir>/vllm_model (a
    temporary folder without --output-dir, removed at exit): the trainer pushes its weights before the first RL
    batch."""
    if args.model != "embedded":
        return args.model
    root = args.output_dir
    if root is None:
        root = tempfile.mkdtemp(prefix="ludic-fast-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)  # after the server's close (registered later)
    path = Path(root) / "vllm_model"
    fresh, _ = build_model_and_tokenizer(args, tok)
    fresh.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)



def run_sft(args: argparse.Namespace, model: torch.nn.Module, tok: Any, task: PromptAnswerTask, logger: Any,
            stop: StopOnSignal | None = None) -> Any:
    """SFT warm-up on --sft-data, else on the task's training answers in the rollouts' prompt format; returns
    the model (stopped early when `stop` is requested)."""
    if args.sft_data:
        source = DatasetBatchSource.from_chat_jsonl(args.sft_data, tok, batch_size=args.sft_batch_size, seed=args.seed,
                                                    rank=0, world_size=1)
    else:
        if args.env:
            items = env_train.demonstration_items(args, tok, env_train.env_factory(args))
        else:
            chat = resolve_chat_template(tok, args.chat_template)
            items = [sft_item(tok, s["prompt"], s["answer"], chat_template=chat) for s in task.samples]
        source = DatasetBatchSource(items, batch_size=args.sft_batch_size, seed=args.seed, rank=0, world_size=1)
    if getattr(args, "world_size", 1) > 1:  # the global batches, this rank's share of each
        source = RankShareSource(source, args.rank, args.world_size)
    ckpt = checkpoint_config(args, "sft")
    resume = args.resume and ckpt is not None and CheckpointManager(ckpt).resolve() is not None
    trainer = Trainer(
        model=model,
        algo=presets.make_sft(length_normalize=True),
        batch_source=source,
        cfg=trainer_config(args, tok, lr=args.sft_lr, steps=args.sft_steps, sync=0),
        checkpoint_config=ckpt,
        resume_from="latest" if resume else None,
        train_logger=logger,
        lora_config=lora_config(args),
    )
    print(f"sft: {trainer.memory_estimate.format()}", flush=True)
    trainer.train_sync(max(0, args.sft_steps - trainer.step_idx), stop=stop)
    return trainer.model


def make_algorithm(args: argparse.Namespace) -> Any:
    """The RL preset's algorithm (its record's build)."""
    return PRESET_RECORDS[args.preset].build(args, BuildInputs())


def build_rollout_source(args: argparse.Namespace, engine: Any, tok: Any, task: PromptAnswerTask, algo: Any
                         ) -> RolloutBatchSource:
    """The RL batches of the sampling flags (groups, temperature, DAPO dynamic sampling, tie jitter) and the
    preset's credit assigner and curriculum; `ludic-fast train` and the pipeline actor sample alike."""
    dynamic = args.dynamic_sampling if args.dynamic_sampling is not None else args.preset == "dapo"
    return RolloutBatchSource(
        sampler=engine,
        task=task,
        tokenizer=tok,
        credit_assigner=algo.credit_assigner,
        prompts_per_batch=args.prompts_per_batch,
        group_size=args.group_size,
        sampling=SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens),
        seed=args.seed,
        dynamic_sampling=dynamic,
        max_rounds=args.max_rounds,
        tie_jitter=args.tie_jitter,
        curriculum=algo.curriculum,
        chat_template=args.chat_template,
        rank=getattr(args, "rank", 0),
        world_size=getattr(args, "world_size", 1),
        per_group_seeds=getattr(args, "parallel", None) is not None,
    )


def run_rl(
    args: argparse.Namespace,
    model: torch.nn.Module,
    tok: Any,
    task: PromptAnswerTask,
    logger: Any,
    resume: bool,
    stop: StopOnSignal | None = None,
) -> Trainer:
    algo = make_algorithm(args)
    engine = build_engine(args, model, tok)
    if args.env:
        source = env_train.env_source(args, engine, tok, algo, Path(args.output_dir) if args.output_dir else None)
    else:
        source = build_rollout_source(args, engine, tok, task, algo)
    evaluator = None
    if args.eval_every > 0 and args.env:
        evaluator = env_train.env_evaluator(args, engine, tok)
    elif args.eval_every > 0:
        evaluator = Evaluator(
            sampler=engine,
            task=task,
            tokenizer=tok,
            sampling=SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens),
            chat_template=args.chat_template,
        )
    cfg = trainer_config(args, tok, lr=args.lr, steps=args.rl_steps, sync=1)
    cfg.eval_every_n_steps = args.eval_every if evaluator is not None else None
    cfg.eval_at_start = evaluator is not None and not resume
    trainer = Trainer(
        model=model,
        algo=algo,
        batch_source=source,
        cfg=cfg,
        publisher=EngineVersion(engine) if args.parallel else engine,
        evaluator=evaluator,
        checkpoint_config=checkpoint_config(args, "rl"),
        resume_from="latest" if resume else None,
        train_logger=logger,
        reducers=default_reducers(),
        lora_config=None if hasattr(model, "peft_config") else lora_config(args),  # SFT may have wrapped it
    )
    print(f"rl: {trainer.memory_estimate.format()}", flush=True)
    trainer.push_weights()  # the engine samples the first batch with the trained (SFT's) weights, not --model's
    trainer.train_sync(max(0, args.rl_steps - trainer.step_idx), stop=stop)
    return trainer

