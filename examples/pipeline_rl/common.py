"""Flags shared by the pipeline example's actor and learner (on top of `ludic-fast train`'s), and the check that
Redis answers, made with redis-py alone before the training stack loads (importing torch takes seconds)."""

from __future__ import annotations

import argparse
import sys

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def add_pipeline_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group("pipeline")
    g.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    g.add_argument("--prefix", default="ludic", help="key prefix shared by the actors and the learner of one run")
    return g


def redis_error(url: str) -> str | None:
    """Why the Redis server at `url` cannot be used (one line), or None when it answers a PING. A server never
    reached is not waited for; one lost later is (`ludic_fast.distributed.redis_conn.ReconnectingRedis`)."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5.0, socket_timeout=5.0, retry=Retry(NoBackoff(), 0))
    except ValueError as exc:  # not a redis://, rediss:// or unix:// URL
        return f"--redis-url: {exc}"
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as exc:
        return f"--redis-url: {exc}"
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        return f"--redis-url: cannot reach Redis ({exc}); start redis-server there or fix the URL"
    except redis.exceptions.RedisError as exc:  # e.g. a password is required
        return f"--redis-url: {exc}"
    finally:
        client.close()
    return None


def exit_status_without_redis(prog: str, argv: list[str] | None) -> int | None:
    """2, after one line on stderr, when the Redis server of --redis-url in `argv` does not answer; else None
    (also for --help)."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        return None
    pre = argparse.ArgumentParser(add_help=False)
    add_pipeline_args(pre)
    error = redis_error(pre.parse_known_args(argv)[0].redis_url)
    if error is None:
        return None
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2
