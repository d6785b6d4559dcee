"""examples/pipeline_rl/learner.py under torchrun (`--parallel ddp|fsdp2`), on 2 gloo ranks forked from this
process with torchrun's variables (as tests/test_cli_parallel.py) and a real redis-server: rank 0 reads the stream
and broadcasts each global batch, each rank trains its share, rank 0 publishes. On the same items, the 2-rank
learner publishes the 1-rank learner's parameters; a checkpoint written on 2 ranks resumes on 1 to the same
parameters, with every item trained exactly once (counted by id); SIGINT to rank 0 while it waits for a batch
stops both ranks with a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("redis", reason="needs the redis Python client")
pytest.importorskip("msgpack", reason="needs msgpack")

from _ranks import assert_same_params, fork_ranks  # noqa: E402
from _redis import needs_server  # noqa: E402

from ludic_fast.data.types import ActorTokenLogps, SampleAttachments, SAWItem  # noqa: E402
from ludic_fast.distributed.pipeline import PipelineKeys, PipelineProducer  # noqa: E402
from ludic_fast.distributed.pipeline_ranks import BroadcastBatchSource, decode_batch, encode_batch  # noqa: E402
from ludic_fast.distributed.publish import RedisWeightSubscriber  # noqa: E402
from ludic_fast.run.loggers import read_jsonl  # noqa: E402

pytestmark = [needs_server, pytest.mark.timeout(240)]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "pipeline_rl"
LR = 3e-3
BATCH = 8  # --prompts-per-batch 4 x --group-size 2


def _item(i: int, n_tokens: int = 6) -> SAWItem:
    ids = [(7 * i + 3 * k) % 11 for k in range(n_tokens)]
    logps = [-1.0 - 0.1 * k for k in range(n_tokens - 2)]
    return SAWItem(ids, [1] * n_tokens, [0, 0] + [1] * (n_tokens - 2), weight=float(i % 3) - 1.0,
                   meta={"total_reward": float(i)}, attachments=SampleAttachments(ActorTokenLogps(logps)))


def _learner(argv: list[str]) -> int:
    import learner

    return learner.main(argv)


def launch(url: str, prefix: str, out: Path, world: int, *extra: str, mode: str = "ddp", on_start=None) -> list[int]:
    """The learner on `world` forked ranks with torchrun's variables and --parallel `mode`; the exit codes."""
    argv = ["--redis-url", url, "--prefix", prefix, "--output-dir", str(out), "--parallel", mode,
            "--model", "embedded", "--seed", "3", "--logger", "none", "--lr", str(LR), "--threads", "1",
            "--sft-steps", "0", "--prompts-per-batch", "4", "--group-size", "2", "--max-lag", "1000",
            "--eval-every", "0", "--device", "cpu", *extra]
    return fork_ranks(lambda: _learner(argv), world, on_start=on_start, timeout_s=180)


def push(url: str, prefix: str, n: int) -> list[str]:
    producer = PipelineProducer(url, keys=PipelineKeys(prefix), actor_id="a")
    return producer.push_round([_item(i) for i in range(n)], 0)


def published(url: str, prefix: str) -> tuple[int, dict[str, torch.Tensor]]:
    got = {}
    sub = RedisWeightSubscriber(url, lambda state, version: got.update(state), keys=PipelineKeys(prefix))
    version = sub.poll()
    sub.close()
    return version, got


def assert_same_stats(a: Path, b: Path) -> None:
    """The runs' logged batch counts and grad norms agree: AdamW does not see a gradient's scale, nor a share of
    the batch trained on several ranks at once (`assert_same_params`), the logged sums over the ranks do."""
    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3]
    for key in ("train/num_samples", "train/target_rollouts"):
        assert [r[key] for r in ra] == [r[key] for r in rb] == [BATCH] * 3, key
    assert [r["train/grad_norm"] for r in rb] == pytest.approx([r["train/grad_norm"] for r in ra], rel=1e-4)


def trained_ids(out: Path) -> list[tuple[int, list[str]]]:
    return [(r["step"], r["ids"]) for r in read_jsonl(out / "trained_ids.jsonl")]


@pytest.fixture(scope="module", autouse=True)
def _learner_importable():
    sys.path.insert(0, str(EXAMPLES))
    import learner  # noqa: F401  (imported once here: the forked ranks inherit it)

    from ludic_fast.cli import train  # noqa: F401

    yield
    sys.path.remove(str(EXAMPLES))


def test_batch_codec_roundtrip_and_source_checks():
    from ludic_fast.data.types import SAWBatch

    items = [_item(i) for i in range(3)]
    for i, item in enumerate(items):
        item.meta.update(item_id=f"a@x:{i}", policy_version=i)
    back = decode_batch(encode_batch(SAWBatch(items=items, meta={"num_samples": 3, "policy_version": 2})))
    assert back.meta == {"num_samples": 3, "policy_version": 2}
    assert [i.to_dict() for i in back.items] == [i.to_dict() for i in items]
    with pytest.raises(ValueError, match="inner must be"):
        BroadcastBatchSource(None, 0, 2)
    with pytest.raises(ValueError, match="rank must lie"):
        BroadcastBatchSource(None, 2, 2)


def test_two_rank_learner_equals_one_rank_and_resumes_on_one_rank(redis_server, tmp_path):
    url = redis_server.url
    # uninterrupted, 1 rank: 3 steps of 8 items
    push(url, "one", 3 * BATCH)
    assert launch(url, "one", tmp_path / "one", 1, "--rl-steps", "3") == [0]
    # 2 ranks (FSDP2), 3 steps: the same parameters
    ids = push(url, "two", 3 * BATCH)
    assert launch(url, "two", tmp_path / "two", 2, "--rl-steps", "3", mode="fsdp2") == [0, 0]
    assert [s for s, _ in trained_ids(tmp_path / "two")] == [1, 2, 3]
    assert sum((i for _, i in trained_ids(tmp_path / "two")), []) == ids  # rank 0 alone read the stream
    v_one, w_one = published(url, "one")
    v_two, w_two = published(url, "two")
    assert v_one == v_two == 3
    assert_same_params(w_two, w_one, lr=LR, steps=3)
    assert_same_stats(tmp_path / "one", tmp_path / "two")
    # 2 ranks (DDP), 2 steps, checkpoint; resumed on 1 rank for the third: the same parameters, each item once
    ids = push(url, "cut", 3 * BATCH)
    cut = tmp_path / "cut"
    assert launch(url, "cut", cut, 2, "--rl-steps", "2", "--checkpoint-every", "2") == [0, 0]
    assert json.loads((cut / "rl" / "latest.json").read_text())["step"] == 2
    assert launch(url, "cut", cut, 1, "--rl-steps", "3", "--checkpoint-every", "2", "--resume") == [0]
    trained = trained_ids(cut)
    assert [s for s, _ in trained] == [1, 2, 3]
    assert sorted(sum((i for _, i in trained), [])) == sorted(ids)
    version, w_cut = published(url, "cut")
    assert version > 2  # versions continue above what the 2-rank learner published
    assert_same_params(w_cut, w_one, lr=LR, steps=3)
    assert_same_stats(tmp_path / "one", cut)


def test_sigint_to_rank_0_waiting_for_a_batch_stops_both_ranks_with_a_checkpoint(redis_server, tmp_path):
    """One batch on the stream, 5 steps asked: rank 0 waits for the second batch (rank 1 in the broadcast) when
    SIGINT reaches it; both ranks stop, the checkpoint of step 1 acknowledges its items, exit 130."""
    url, out = redis_server.url, tmp_path / "run"
    push(url, "sig", BATCH)

    def interrupt_rank_0(procs):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.1)
        os.kill(procs[0].pid, signal.SIGINT)

    codes = launch(url, "sig", out, 2, "--rl-steps", "5", "--checkpoint-every", "5", on_start=interrupt_rank_0)
    assert codes == [130, 130]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (out / "rl").glob("step_*")) == ["step_000001"]
    assert PipelineProducer(url, keys=PipelineKeys("sig")).conn.call(lambda c: c.xlen("sig:items"), "XLEN") == 0
