"""Pipeline RL learner: the bundled Trainer fed from Redis, publishing its weights to the actors after every step.

    python examples/pipeline_rl/learner.py --redis-url redis://HOST:6379/0 --prefix run1 \\
        --rl-steps 100 --prompts-per-batch 8 --group-size 8 --max-lag 2

Model, task, preset and trainer flags are those of `ludic-fast train` (defaults: the embedded tiny model and
addition task); the actors must use the same --model/--task/--preset/--group-size/--temperature. With
--sft-steps > 0 the learner first runs the SFT warm-up, then publishes those weights as version 0; actors
wait for them. SIGINT / SIGTERM finish the current step (or stop waiting for a batch), tell the actors to stop,
print one line and exit 130 / 143; no Redis at --redis-url: one line, exit 2. See docs/distributed.md.
"""

from __future__ import annotations

import sys

from common import add_pipeline_args, exit_status_without_redis

PROG = "examples/pipeline_rl/learner.py"


def main(argv: list[str] | None = None) -> int:
    status = exit_status_without_redis(PROG, argv)  # before the training stack loads: fails in seconds
    return run(argv) if status is None else status


def run(argv: list[str] | None) -> int:
    import contextlib

    import torch

    from ludic_fast.cli.train import (
        build_console_logger,
        build_model_and_tokenizer,
        build_parser,
        make_algorithm,
        prepare,
        run_sft,
        trainer_config,
    )
    from ludic_fast.cli.validation import UsageError
    from ludic_fast.distributed.pipeline import PipelineBatchSource, PipelineKeys, StopRequested
    from ludic_fast.distributed.publish import RedisWeightPublisher
    from ludic_fast.engine.stop import StopOnSignal
    from ludic_fast.run.stats import default_reducers
    from ludic_fast.trainer import Trainer

    parser = build_parser(PROG)
    add_pipeline_args(parser)
    args = parser.parse_args(argv)
    try:
        if args.checkpoint_every > 0 or args.resume:
            raise UsageError("--checkpoint-every/--resume: the pipeline learner keeps no checkpoints")
        tok, task = prepare(args, "train")  # the same input checks as `ludic-fast train`
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with StopOnSignal() as stop:  # SIGINT / SIGTERM: finish the current step, then stop (exit 130 / 143)
        model, tok = build_model_and_tokenizer(args, tok)
        logger = build_console_logger(args.logger)
        if args.sft_steps > 0:
            model = run_sft(args, model, tok, task, logger, stop=stop)
        if stop.requested:
            print(f"[learner] stopped by {stop.signal_name} in the SFT warm-up: nothing published", file=sys.stderr)
            return stop.exit_code
        keys = PipelineKeys(args.prefix)
        publisher = RedisWeightPublisher(args.redis_url, keys=keys)
        publisher.publish({n: p.detach() for n, p in model.named_parameters()}, version=0)  # what actors start from
        source = PipelineBatchSource(args.redis_url, keys=keys, batch_size=args.prompts_per_batch * args.group_size,
                                     max_lag=args.max_lag, stop_requested=lambda: stop.requested)
        cfg = trainer_config(args, tok, lr=args.lr, steps=args.rl_steps, sync=1)  # as `ludic-fast train`'s RL phase
        trainer = Trainer(model=model, algo=make_algorithm(args), batch_source=source, cfg=cfg, publisher=publisher,
                          train_logger=logger, reducers=default_reducers())
        with contextlib.suppress(StopRequested):  # stopped while waiting for a batch
            trainer.train_sync(args.rl_steps, stop=stop)
        source.commit()  # the batches trained on
        source.mark_done()  # the actors stop
        if stop.requested:
            print(f"[learner] stopped by {stop.signal_name} after RL step {trainer.step_idx}: its weights are "
                  f"published (version {trainer.step_idx}), the batches trained on acknowledged, the actors told "
                  "to stop; the learner keeps no checkpoint", file=sys.stderr)
            return stop.exit_code
    print(f"[learner] done: {trainer.step_idx} steps; pipeline counters {source.counters}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
