"""Pipeline RL learner: the bundled Trainer fed from Redis, publishing its weights to the actors after every step.

    python examples/pipeline_rl/learner.py --redis-url redis://HOST:6379/0 --prefix run1 \\
        --rl-steps 100 --prompts-per-batch 8 --group-size 8 --max-lag 2 \\
        --output-dir runs/run1 --checkpoint-every 10        # later, after a crash: the same command + --resume

Model, task, preset and trainer flags are those of `ludic-fast train` (defaults: the embedded tiny model and
addition task); the actors must use the same --model/--task/--preset/--group-size/--temperature. With
--sft-steps > 0 the learner first runs the SFT warm-up, then publishes those weights; actors wait for them.
With --output-dir it writes metrics.jsonl (every step) and trained_ids.jsonl ({"step", "ids"}: the item ids
each step trained on). --checkpoint-every N writes a checkpoint under <output-dir>/rl every N steps (and at the
end or on a stop); a stream entry is acknowledged only once a checkpoint covering it is on disk, so --resume
after a crash at any moment trains every item exactly once in the final model's lineage, and publishes
versions above any the actors loaded (`ludic_fast.distributed.versions`); both .jsonl files drop the records
after the checkpoint's step. SIGINT / SIGTERM finish the current step (or stop waiting for a batch), save a
checkpoint when checkpointing, tell the actors to stop, print one line and exit 130 / 143; no Redis at
--redis-url: one line, exit 2. See docs/distributed.md.

Under torchrun (`torchrun --nproc-per-node K examples/pipeline_rl/learner.py --parallel ddp|fsdp2 --output-dir
...`), rank 0 alone reads the stream, publishes the weights and writes the output directory; every rank trains
its share of each global batch (`ludic_fast.distributed.pipeline_ranks`); checkpoints are sharded and resume on
any number of ranks.
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

    from ludic_fast.cli import parallel
    from ludic_fast.cli.train import build_parser, check_resume, prepare
    from ludic_fast.cli.validation import UsageError
    from ludic_fast.distributed.launch import AgreedStop
    from ludic_fast.engine.stop import StopOnSignal

    parser = build_parser(PROG)
    add_pipeline_args(parser)
    args = parser.parse_args(argv)
    try:
        if (args.checkpoint_every > 0 or args.resume) and args.output_dir is None:
            raise UsageError("--checkpoint-every/--resume need --output-dir (where the checkpoints live)")
        parallel.check_launch(args)  # sets args.rank / args.world_size
        resume_step = check_resume(args, ("rl",))  # None without --resume; an error when there is no checkpoint
        tok, task = prepare(args, "train")  # the same input checks as `ludic-fast train`
    except UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    stop = AgreedStop() if parallel.start(args) else StopOnSignal()
    try:
        return _learn(args, resume_step, tok, task, stop)
    finally:
        parallel.finish(args)


def _learn(args, resume_step, tok, task, stop) -> int:
    import contextlib
    from pathlib import Path

    from ludic_fast.cli import parallel
    from ludic_fast.cli.train import (
        build_console_logger,
        build_model_and_tokenizer,
        checkpoint_config,
        make_algorithm,
        run_sft,
        trainer_config,
    )
    from ludic_fast.distributed.pipeline import PipelineBatchSource, PipelineKeys, StopRequested, published_version
    from ludic_fast.distributed.pipeline_ranks import BroadcastBatchSource
    from ludic_fast.distributed.publish import RedisWeightPublisher
    from ludic_fast.distributed.versions import OffsetPublisher, start_version
    from ludic_fast.run.loggers import JSONLLogger, TeeLogger, keep_records_for_resume
    from ludic_fast.run.stats import default_reducers
    from ludic_fast.trainer import Trainer

    main_rank = parallel.is_main(args)  # rank 0 reads the stream, publishes and writes the output directory
    out = None if args.output_dir is None else Path(args.output_dir)
    ids_log = None
    console = build_console_logger(args.logger if main_rank else "none")
    sft_logger = rl_logger = console
    if out is not None and main_rank:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "trained_ids.jsonl"):  # a resume keeps the warm-up's records whole
            keep_records_for_resume(out / name, phases=("sft", "rl"), resumed=None if resume_step is None else "rl",
                                    step=resume_step)
        ids_log = JSONLLogger(out / "trained_ids.jsonl", extra={"phase": "rl"})
        sft_logger = TeeLogger(console, JSONLLogger(out / "metrics.jsonl", extra={"phase": "sft"}))
        rl_logger = TeeLogger(console, JSONLLogger(out / "metrics.jsonl", extra={"phase": "rl"}))
    with stop:  # SIGINT / SIGTERM: finish the current step, then stop (exit 130 / 143)
        model, tok = build_model_and_tokenizer(args, tok)
        model = parallel.wrap(args, model)  # DDP / FSDP2 under --parallel
        if args.sft_steps > 0 and resume_step is None:  # resumed: the RL checkpoint holds the weights
            model = run_sft(args, model, tok, task, sft_logger, stop=stop)
        if stop.requested:
            if main_rank:
                print(f"[learner] stopped by {stop.signal_name} in the SFT warm-up: nothing published",
                      file=sys.stderr)
            return stop.exit_code
        keys = PipelineKeys(args.prefix)
        trainer = None
        source = None
        if main_rank:
            source = PipelineBatchSource(
                args.redis_url, keys=keys, batch_size=args.prompts_per_batch * args.group_size,
                max_lag=args.max_lag, ack_after_checkpoint=args.checkpoint_every > 0 or args.resume,
                stop_requested=lambda: stop.signum is not None,  # this rank's signal: no collective on one rank
                on_deliver=None if ids_log is None else lambda ids: ids_log.log(trainer.step_idx + 1, {"ids": ids}),
            )
        batches = source if args.parallel is None else BroadcastBatchSource(source, args.rank, args.world_size)
        publisher = OffsetPublisher(RedisWeightPublisher(args.redis_url, keys=keys))  # used on rank 0 alone
        cfg = trainer_config(args, tok, lr=args.lr, steps=args.rl_steps, sync=1)  # as `ludic-fast train`'s RL phase
        cfg.max_lag = None  # the source drops stale items, in published versions (which a resume shifts)
        trainer = Trainer(model=model, algo=make_algorithm(args), batch_source=batches, cfg=cfg, publisher=publisher,
                          train_logger=rl_logger, reducers=default_reducers(),
                          checkpoint_config=checkpoint_config(args, "rl"),
                          resume_from=None if resume_step is None else "latest")
        if main_rank:
            first = start_version(source.checkpoint_version, published_version(source.conn, keys))
            publisher.offset = first - trainer.step_idx
        trainer.push_weights()  # what the actors sample with next: version `first` (collective under FSDP2)
        if main_rank and resume_step is not None:
            print(f"[learner] resumed at step {trainer.step_idx}: publishing version {first}", flush=True)
        with contextlib.suppress(StopRequested):  # stopped while waiting for a batch (on every rank)
            trainer.train_sync(max(0, args.rl_steps - trainer.step_idx), stop=stop)
        if trainer.checkpointer is None:
            if main_rank:
                source.commit()  # the batches trained on
        elif trainer.checkpointer.latest_step() != trainer.step_idx:
            trainer.save_checkpoint()  # acknowledges what it covers (collective under --parallel)
        if main_rank:
            source.mark_done()  # the actors stop
        if stop.requested:  # under --parallel a collective, read once by every rank
            if main_rank:
                kept = (f"a checkpoint of that step under {out / 'rl'}" if trainer.checkpointer is not None
                        else "no checkpoint (--checkpoint-every 0)")
                print(f"[learner] stopped by {stop.signal_name} after RL step {trainer.step_idx}: its weights are "
                      f"published (version {trainer.step_idx + publisher.offset}), the batches trained on "
                      f"acknowledged, the actors told to stop; {kept}", file=sys.stderr)
            return stop.exit_code
    if main_rank:
        print(f"[learner] done: {trainer.step_idx} steps; pipeline counters {source.counters}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
