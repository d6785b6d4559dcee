"""Pipeline RL actor: rollouts with the latest published weights, credit assignment, SAWItems pushed to Redis.

    python examples/pipeline_rl/actor.py --redis-url redis://HOST:6379/0 --prefix run1 --actor-id a0 --seed 1

Model, task, preset and sampling flags are those of `ludic-fast train` and must match the learner's;
`--sampler vllm` samples with an in-process vLLM (GPU) that loads each published version. Give every actor
its own --actor-id and --seed. Runs until the learner marks the run done (or --rounds batches), logging
each round; it waits while the stream holds --max-queued items (default: 4 learner batches), so it never
runs far ahead of the learner. SIGINT / SIGTERM push the round in progress (or stop waiting), print one line and
exit 130 / 143; no Redis at --redis-url: one line, exit 2. See docs/distributed.md.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from common import add_pipeline_args, exit_status_without_redis

PROG = "examples/pipeline_rl/actor.py"


def main(argv: list[str] | None = None) -> int:
    status = exit_status_without_redis(PROG, argv)  # before the training stack loads: fails in seconds
    return run(argv) if status is None else status


def run(argv: list[str] | None) -> int:
    import torch

    from ludic_fast.cli.train import (
        build_engine,
        build_model_and_tokenizer,
        build_parser,
        build_rollout_source,
        make_algorithm,
        prepare,
    )
    from ludic_fast.cli.validation import UsageError
    from ludic_fast.distributed.pipeline import PipelineKeys, PipelineProducer, run_pipeline_actor
    from ludic_fast.distributed.publish import RedisWeightSubscriber
    from ludic_fast.engine.stop import StopOnSignal

    parser = build_parser(PROG)
    g = add_pipeline_args(parser)
    g.add_argument("--actor-id", default=None, help="unique per actor (default: random)")
    g.add_argument("--rounds", type=int, default=None, help="batches to push (default: until the learner is done)")
    g.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="wait while the stream holds this many items (default: 4 x prompts-per-batch x group-size)",
    )
    args = parser.parse_args(argv)
    max_queued = args.max_queued if args.max_queued is not None else 4 * args.prompts_per_batch * args.group_size
    try:
        tok, task = prepare(args, "train")  # the same input checks as `ludic-fast train`
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tok = build_model_and_tokenizer(args, tok)  # the architecture; the weights come from the learner
    engine = build_engine(args, model.to(args.device), tok)  # --sampler hf (transformers generate) or vllm
    rollouts = build_rollout_source(args, engine, tok, task, make_algorithm(args))  # as `ludic-fast train`
    keys = PipelineKeys(args.prefix)
    subscriber = RedisWeightSubscriber(args.redis_url, engine.publish, keys=keys)  # load_state_dict + version
    producer = PipelineProducer(args.redis_url, keys=keys, actor_id=args.actor_id, max_queued=max_queued)

    def make_items(version: int):
        return asyncio.run(rollouts.next_batch()).items

    with StopOnSignal() as stop:  # SIGINT / SIGTERM: push the round in progress, then stop (exit 130 / 143)
        pushed = run_pipeline_actor(make_items, producer, poll_weights=subscriber.poll, num_rounds=args.rounds,
                                    stop_requested=lambda: stop.requested)
        if stop.requested:
            print(f"[actor {producer.actor_id}] stopped by {stop.signal_name}: pushed {pushed} items (nothing else "
                  "to save); start it again to go on", file=sys.stderr)
            return stop.exit_code
    print(f"[actor {producer.actor_id}] pushed {pushed} items; last policy version {subscriber.version}; weight "
          f"loads {dict(subscriber.counters)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
