"""Multi-turn episodes on the CPU: rollout throughput of the episode runner, and the training step time of a
multi-turn batch beside a single-turn batch of the same token count.

Rollouts: `--episodes` episodes of an embedded environment (`--env embedded-guess` or `embedded-calc`) played by
`EpisodeRunner` with the transformers sampler (`--sampler hf`) or vLLM in-process (`--sampler vllm`, needs vLLM's
CPU build: .venv-vllm), the embedded tiny Llama (random init, seeded, `--lm-head-scale` sharpens it) warmed up
with `--sft-steps` SFT steps on the environment's demonstrations so episodes run several turns. One warm-up
call, then `--repeats` timed calls: episodes/s, sampled tokens/s (action tokens) and all tokens/s (the whole
sequences), median and min-max.

Step time: one CISPO step of the trainer (forward, fused-head loss, backward, optimizer) on (a) the per-step
items of those episodes (`--episode-items step`), (b) one item per episode, (c) single-turn items of the same
lengths as (b), each with one prompt then one completion holding as many action tokens; `--repeats` steps each
after a warm-up, median and min-max.

    python bench/agents_rollout.py                            # transformers, embedded-guess
    .venv-vllm/bin/python bench/agents_rollout.py --sampler vllm
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from ludic_fast import algorithm as presets
from ludic_fast.agents import EpisodeJob, EpisodeLimits, EpisodeRunner, episode_items
from ludic_fast.agents.env_registry import ENVS
from ludic_fast.agents.episode import ChatTokens, demonstration_tokens
from ludic_fast.agents.tools import as_tools
from ludic_fast.data.credit import EpisodicReturn
from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWBatch, SAWItem
from ludic_fast.embedded import build_tiny_model
from ludic_fast.embedded.tokenizer import ASCII_CHARACTERS, build_char_tokenizer
from ludic_fast.rollout import HFSampler, SamplingConfig
from ludic_fast.trainer import Trainer, TrainerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="embedded-guess", choices=ENVS.names())
    p.add_argument("--sampler", default="hf", choices=["hf", "vllm"])
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--max-episode-tokens", type=int, default=256)
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lm-head-scale", type=float, default=1.0)
    args = p.parse_args(argv)
    for name in ("episodes", "max_new_tokens", "max_episode_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.sft_steps < 0:
        p.error("--sft-steps must be >= 0")
    return args


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


class FixedSource:
    """The same SAW batch every step."""

    def __init__(self, items: list[SAWItem]):
        self.items = items

    async def next_batch(self) -> SAWBatch:
        return SAWBatch(items=list(self.items), meta={"target_rollouts": len(self.items)})


def trainer_for(model, tok, items: list[SAWItem], lr: float) -> Trainer:
    cfg = TrainerConfig(model_device="cpu", lr=lr, pad_token_id=tok.pad_token_id, max_seq_len=1024,
                        micro_token_budget=16384, sync_every_steps=0)
    return Trainer(model=model, algo=presets.make_cispo(group_size=1), batch_source=FixedSource(items), cfg=cfg)


def warm_up(model, tok, env_name: str, steps: int) -> None:
    """SFT on the environment's demonstrations, so episodes run several turns."""
    if steps == 0:
        return
    env = ENVS[env_name].factory()
    tools = [t.schema for t in as_tools(getattr(env, "tools", None)).values()] or None
    chat = ChatTokens(tok, [tok.eos_token_id], tools=tools)
    items = []
    for messages in env.demonstrations(256, 0):
        t = demonstration_tokens(chat, messages)
        items.append(SAWItem(t.ids, [1] * len(t.ids), t.action_mask, 1.0))
    trainer = Trainer(model=model, algo=presets.make_sft(length_normalize=True), batch_source=FixedSource(items),
                      cfg=TrainerConfig(model_device="cpu", lr=3e-3, pad_token_id=tok.pad_token_id,
                                        max_seq_len=1024, micro_token_budget=16384, sync_every_steps=0))
    trainer.train_sync(steps)


def single_turn_twins(items: list[SAWItem]) -> list[SAWItem]:
    """Items of the same lengths and action-token counts with one prompt then one contiguous completion."""
    out = []
    for it in items:
        n, a = len(it.input_ids), sum(it.action_mask)
        out.append(SAWItem(it.input_ids, [1] * n, [0] * (n - a) + [1] * a, it.weight,
                           attachments=SampleAttachments(ActorTokenLogps(list(it.actor_logps.token_logps)))))
    return out


def step_times(model, tok, items: list[SAWItem], repeats: int) -> list[float]:
    trainer = trainer_for(model, tok, items, lr=1e-6)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        trainer.train_sync(1)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    tok = build_char_tokenizer(ASCII_CHARACTERS)
    model = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             max_position_embeddings=args.max_episode_tokens)
    warm_up(model, tok, args.env, args.sft_steps)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.lm_head_scale)
    model.eval()
    limits = EpisodeLimits(max_tokens=args.max_episode_tokens, max_new_tokens=args.max_new_tokens)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
    tmp = None
    if args.sampler == "vllm":
        from ludic_fast.rollout.vllm_sampler import VLLMSampler

        tmp = tempfile.TemporaryDirectory()
        model.save_pretrained(tmp.name)
        tok.save_pretrained(tmp.name)
        sampler = VLLMSampler(tmp.name, eos_token_id=tok.eos_token_id, seed=0, dtype="float32",
                            max_model_len=args.max_episode_tokens, enforce_eager=True,
                            kv_cache_memory_bytes=256 << 20)
    else:
        sampler = HFSampler(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    runner = EpisodeRunner(sampler, tok, sampling=sampling, limits=limits)
    env_cls = ENVS[args.env].factory

    def play(seed: int):
        jobs = [EpisodeJob(env_cls(), seed * 100_000 + i, {"group_id": str(i)}) for i in range(args.episodes)]
        return asyncio.run(runner.run(jobs, seed=seed))

    play(0)
    eps_s, act_s, all_s, turns = [], [], [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        episodes = play(r + 1)
        dt = time.perf_counter() - t0
        eps_s.append(len(episodes) / dt)
        act_s.append(sum(sum(e.tokens.action_mask) for e in episodes) / dt)
        all_s.append(sum(len(e.tokens.ids) for e in episodes) / dt)
        turns.append(statistics.mean(e.turns for e in episodes))
    print(f"{args.env}, {args.episodes} episodes per call, <= {args.max_new_tokens} tokens per turn, sampler "
          f"{args.sampler}, torch threads {torch.get_num_threads()}; turns per episode {statistics.mean(turns):.2f}")
    print("| rollouts | median (min-max) |")
    print("|---|---:|")
    print(f"| episodes/s | {spread(eps_s)} |")
    print(f"| sampled tokens/s | {spread(act_s)} |")
    print(f"| all tokens/s | {spread(all_s)} |")
    if tmp is not None:
        del sampler
        tmp.cleanup()
    model.train()
    per_step = episode_items(episodes, EpisodicReturn(), per="step")
    per_episode = episode_items(episodes, EpisodicReturn(), per="episode")
    twins = single_turn_twins(per_episode)
    print("| training step (CISPO) | items | tokens | action tokens | step s, median (min-max) |")
    print("|---|---:|---:|---:|---:|")
    for name, items in (("multi-turn, one item per turn", per_step), ("multi-turn, one item per episode", per_episode),
                        ("single-turn, same lengths", twins)):
        times = step_times(model, tok, items, args.repeats)
        print(f"| {name} | {len(items)} | {sum(len(i) for i in items):,} | {sum(sum(i.action_mask) for i in items):,} "
              f"| {statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}) |")


if __name__ == "__main__":
    main()
