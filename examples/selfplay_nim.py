"""Self-play on the CPU: the tiny embedded model learns one-pile Nim by playing both seats against itself, and
is measured against the fixed random opponent before and after.

    python examples/selfplay_nim.py --seed 0

1. SFT warm-up on random-move games (`NimGame.demonstrations`: each seat's conversation, tokenised as
   episodes are): the model learns the format and which moves are legal (a move names the pile it leaves, so
   the legal answers depend on the pile), not good play.
2. Evaluation against the random opponent (`VersusEnv`, the model on seat seed % 2, greedy), 128 fixed games;
   a turn cut by the token limit counts as a loss.
3. RL by self-play: `SelfPlayRunner` plays both seats with the policy being trained; each seat's turns are its
   own episode, credited with that seat's reward (+1 win, -1 loss), GRPO groups per (seed, seat); CISPO loss.
   Every 5 steps: P(leave a multiple of 3 | the first pile), the optimal move, at piles 4, 5, 7 and 8.
4. The same evaluation again. Printed: `reward vs random before X after Y` (mean reward, in [-1, 1]) and the
   win rates.
"""

from __future__ import annotations

import argparse

import torch

from ludic_fast.agents import EnvBatchSource, EpisodeJob, EpisodeLimits, EpisodeRunner
from ludic_fast.agents.embedded_nim import NimGame
from ludic_fast.agents.episode import ChatTokens, demonstration_tokens
from ludic_fast.agents.selfplay import SelfPlayRunner, VersusEnv
from ludic_fast.algorithm import make_cispo, make_grpo, make_sft
from ludic_fast.data.types import SAWItem
from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
from ludic_fast.rollout import DatasetBatchSource, HFSampler, SamplingConfig
from ludic_fast.run.loggers import PrintLogger
from ludic_fast.run.stats import default_reducers
from ludic_fast.trainer import Trainer, TrainerConfig


def evaluate(engine: HFSampler, tok, games: int) -> dict[str, float]:
    """Greedy games against the random opponent on fixed seeds (the model on seat seed % 2): mean reward and win
    rate. An episode that did not end as a finished game (a turn cut by max_new_tokens) counts as a loss, -1,
    as it resigns in self-play."""
    runner = EpisodeRunner(engine, tok, limits=EpisodeLimits(max_tokens=256, max_new_tokens=3),
                           sampling=SamplingConfig(temperature=0.0, max_new_tokens=3))
    jobs = [EpisodeJob(VersusEnv(NimGame()), seed) for seed in range(10**6, 10**6 + games)]
    rewards = [e.rollout.total_reward if e.status == "done" else -1.0 for e in runner.run_sync(jobs)]
    return {"reward": sum(rewards) / games, "success": sum(r >= 1.0 for r in rewards) / games}


def winning_move_probability(model, tok) -> dict[int, float]:
    """P(leaving a multiple of 3 | seat 0's first prompt at that pile), at the first piles 4-9 that have one."""
    chat, out = ChatTokens(tok, [tok.eos_token_id]), {}
    for pile in (4, 5, 7, 8):
        game = NimGame(min_stones=pile, max_stones=pile)
        game.reset(0)
        ids = chat.prompt_ids([{"role": "user", "content": game.observation(0)}])
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        out[pile] = round(float(probs[tok.convert_tokens_to_ids(str(pile - pile % 3))]), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft-steps", type=int, default=100)
    p.add_argument("--rl-steps", type=int, default=30)
    p.add_argument("--demonstrations", type=int, default=512, help="random-move games for the SFT warm-up")
    p.add_argument("--seeds-per-batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-games", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4, help="the self-play RL learning rate")
    p.add_argument("--algo", choices=("cispo", "grpo"), default="cispo", help="the RL preset")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)

    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=args.seed,
                             max_position_embeddings=256)
    chat = ChatTokens(tok, [tok.eos_token_id])
    items = []
    for messages in NimGame().demonstrations(args.demonstrations, args.seed):
        t = demonstration_tokens(chat, messages)
        items.append(SAWItem(input_ids=t.ids, attention_mask=[1] * len(t.ids), action_mask=t.action_mask,
                             weight=1.0, meta={"completion_length": sum(t.action_mask)}))
    sft = Trainer(
        model=model, algo=make_sft(length_normalize=True),
        batch_source=DatasetBatchSource(items, batch_size=32, seed=args.seed, rank=0, world_size=1),
        cfg=TrainerConfig(model_device="cpu", pad_token_id=tok, lr=3e-3, weight_decay=0.0, sync_every_steps=0,
                          max_seq_len=256, micro_token_budget=8192),
        train_logger=PrintLogger(prefix="[sft]", keys=["train/loss"]),
    )
    sft.train_sync(args.sft_steps)

    engine = HFSampler(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    before = evaluate(engine, tok, args.eval_games)
    print("P(leave a multiple of 3 | first pile) before", winning_move_probability(model, tok))

    algo = (make_cispo if args.algo == "cispo" else make_grpo)(group_size=args.group_size)
    runner = SelfPlayRunner(engine, tok, sampling=SamplingConfig(temperature=1.0, max_new_tokens=3), max_tokens=256,
                            max_new_tokens=3)
    source = EnvBatchSource(make_env=NimGame, runner=runner, credit_assigner=algo.credit_assigner,
                            seeds_per_batch=args.seeds_per_batch, group_size=args.group_size, seed=args.seed)
    rl = Trainer(
        model=model, algo=algo, batch_source=source, publisher=engine,
        cfg=TrainerConfig(model_device="cpu", pad_token_id=tok, lr=args.lr, weight_decay=0.0, temperature=1.0,
                          max_seq_len=256, micro_token_budget=8192),
        train_logger=PrintLogger(prefix="[self-play]", keys=["train/avg_total_reward", "train/loss",
                                                              "train/episode_truncated"]),
        reducers=default_reducers(),
    )
    def probe(stats: dict) -> None:
        if rl.step_idx % 5 == 0:
            print(f"[self-play] step {rl.step_idx} P(leave a multiple of 3 | first pile)",
                  winning_move_probability(model, tok))

    rl.train_sync(args.rl_steps, log_fn=probe)
    after = evaluate(engine, tok, args.eval_games)
    print("P(leave a multiple of 3 | first pile) after", winning_move_probability(model, tok))
    print(f"reward vs random before {before['reward']:.3f} after {after['reward']:.3f} "
          f"(win rate {before['success']:.3f} -> {after['success']:.3f}, {args.eval_games} games, seed {args.seed})")


if __name__ == "__main__":
    main()
