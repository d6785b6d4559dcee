"""Pipeline RL learner: the bundled Trainer fed from Redis, publishing its weights to the actors after every step.

    python examples/pipeline_rl/learner.py --redis-url redis://HOST:6379/0 --prefix run1 \\
        --rl-steps 100 --prompts-per-batch 8 --group-size 8 --max-lag 2

Model, task, preset and trainer flags are those of `ludic-fast train` (defaults: the embedded tiny model and
addition task); the actors must use the same --model/--task/--preset/--group-size/--temperature. With
--sft-steps > 0 the learner first runs the SFT warm-up, then publishes those weights as version 0; actors
wait for them. See docs/distributed.md.
"""

from __future__ import annotations

import sys

from common import add_pipeline_args, exit_status_without_redis

PROG = "examples/pipeline_rl/learner.py"


def main(argv: list[str] | None = None) -> int:
    status = exit_status_without_redis(PROG, argv)  # before the training stack loads: fails in seconds
    return run(argv) if status is None else status


def run(argv: list[str] | None) -> int:
    import torch

    from ludic_fast.cli_validation import UsageError
    from ludic_fast.distributed.pipeline import PipelineBatchSource, PipelineKeys
    from ludic_fast.distributed.publish import RedisWeightPublisher
    from ludic_fast.stats import default_reducers
    from ludic_fast.train_cli import (
        build_console_logger,
        build_model_and_tokenizer,
        build_parser,
        make_algorithm,
        prepare,
        run_sft,
        trainer_config,
    )
    from ludic_fast.trainer import Trainer

    parser = build_parser(PROG)
    add_pipeline_args(parser)
    args = parser.parse_args(argv)
    try:
        tok, task = prepare(args, "train")  # the same input checks as `ludic-fast train`
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tok = build_model_and_tokenizer(args, tok)
    logger = build_console_logger(args.logger)
    if args.sft_steps > 0:
        model = run_sft(args, model, tok, task, logger)
    keys = PipelineKeys(args.prefix)
    publisher = RedisWeightPublisher(args.redis_url, keys=keys)
    publisher.publish({n: p.detach() for n, p in model.named_parameters()}, version=0)  # what actors start from
    source = PipelineBatchSource(
        args.redis_url, keys=keys, batch_size=args.prompts_per_batch * args.group_size, max_lag=args.max_lag
    )
    cfg = trainer_config(args, tok, lr=args.lr, steps=args.rl_steps, sync=1)  # as `ludic-fast train`'s RL phase
    trainer = Trainer(model=model, algo=make_algorithm(args), batch_source=source, cfg=cfg, publisher=publisher,
                      train_logger=logger, reducers=default_reducers())
    trainer.train_sync(args.rl_steps)
    source.commit()  # the last batch has been trained on
    source.mark_done()  # the actors stop
    print(f"[learner] done: {trainer.step_idx} steps; pipeline counters {source.counters}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
