"""Pipeline RL actors' throughput on the CPU: items/s pushed by 1, 2 and 4 actor processes at once.

A loopback redis-server (no persistence) in a temporary directory; this script publishes the embedded tiny
model's weights as version 0 (as the learner does) and stands in for the learner by draining the stream as
fast as it can (XREADGROUP, XACK + XDEL), so the actors are never held back by the queue bound. For each
repeat and each actor count N (interleaved: 1, 2, 4, 1, 2, 4, ...), N `examples/pipeline_rl/actor.py`
processes start (--threads 1 each; the embedded model and task, transformers generate), every actor's first
round is left out (start-up), then the items drained over `--window` seconds give items/s; the actors are then
told to stop. Prints one JSON line per measurement (with the 1-minute load average before and after: the
machine may be shared) and the median and min-max per N.

    python bench/pipeline_actors.py --repeats 3 --window 10 --prompts-per-batch 2 --group-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
ACTOR = ROOT / "examples" / "pipeline_rl" / "actor.py"


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", workdir, "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def publish_initial_weights(url: str, prefix: str, flags: list[str]) -> None:
    from ludic_fast.cli.train import build_model_and_tokenizer, build_parser, prepare
    from ludic_fast.distributed.pipeline import PipelineKeys
    from ludic_fast.distributed.publish import RedisWeightPublisher

    args = build_parser("bench").parse_args(flags)
    tok, _ = prepare(args, "train")
    model, _ = build_model_and_tokenizer(args, tok)
    RedisWeightPublisher(url, keys=PipelineKeys(prefix)).publish(
        {n: p.detach() for n, p in model.named_parameters()}, version=0)


def drain(client: redis.Redis, prefix: str) -> int:
    """Read, acknowledge and delete every entry there is now; returns how many."""
    stream, group = f"{prefix}:items", f"{prefix}:learners"
    reply = client.xreadgroup(group, "bench", {stream: ">"}, count=1000, block=50)
    ids = [eid for _, entries in reply for eid, _ in entries] if reply else []
    if ids:
        client.xack(stream, group, *ids)
        client.xdel(stream, *ids)
    return len(ids)


def measure(url: str, n_actors: int, rep: int, args: argparse.Namespace, flags: list[str]) -> dict:
    prefix = f"bench-{n_actors}-{rep}"
    client = redis.Redis.from_url(url)
    client.xgroup_create(f"{prefix}:items", f"{prefix}:learners", id="0", mkstream=True)
    publish_initial_weights(url, prefix, flags)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tempfile.TemporaryFile("w+") for _ in range(n_actors)]
    procs = [subprocess.Popen([sys.executable, str(ACTOR), "--redis-url", url, "--prefix", prefix, "--actor-id",
                               f"a{k}", "--seed", str(k), "--threads", "1", "--max-queued", "100000", *flags],
                              stdout=log, stderr=subprocess.STDOUT, env=env) for k, log in enumerate(logs)]
    round_size = args.prompts_per_batch * args.group_size
    drained = 0
    while drained < n_actors * round_size:  # every actor's first round: start-up, not measured
        drained += drain(client, prefix)
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("an actor exited during start-up")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    items = 0
    while time.perf_counter() - t0 < args.window:
        items += drain(client, prefix)
    elapsed = time.perf_counter() - t0
    client.set(f"{prefix}:done", 1)
    for p in procs:
        p.wait(timeout=120)
    return {"actors": n_actors, "repeat": rep, "items": items, "seconds": round(elapsed, 2),
            "items_per_s": round(items / elapsed, 2), "load1_before": load_before, "load1_after": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=float, default=10.0, help="seconds measured per run")
    p.add_argument("--prompts-per-batch", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    args = p.parse_args()
    flags = ["--prompts-per-batch", str(args.prompts_per_batch), "--group-size", str(args.group_size),
             "--device", "cpu"]
    with tempfile.TemporaryDirectory() as workdir:
        server, url = start_redis(workdir)
        try:
            rows = []
            for rep in range(args.repeats):
                for n in args.actors:
                    rows.append(measure(url, n, rep, args, flags))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            server.kill()
    print(f"\ncpus: {os.cpu_count()}; items/s over {args.window:g} s windows, {args.repeats} repeats")
    for n in args.actors:
        rates = [r["items_per_s"] for r in rows if r["actors"] == n]
        median = statistics.median(rates)
        print(f"{n} actor(s): median {median:.1f} items/s (min {min(rates):.1f}, max {max(rates):.1f})")


if __name__ == "__main__":
    main()
