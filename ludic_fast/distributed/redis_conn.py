"""A Redis client that rides out server restarts: transient errors are retried with backoff until a deadline.

Only a server this process has reached is waited for: while a URL has never answered, a connection error
is a wrong URL or a server not started, and raises `RedisUnreachableError` at once.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors that mean "Redis is (re)starting or unreachable", never "the command is wrong". BusyLoadingError
#: (the server is replaying its append-only file) is a ConnectionError subclass.
TRANSIENT_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

#: the URLs some command of this process has got an answer from
_REACHED: set[str] = set()


class RedisUnreachableError(redis.exceptions.ConnectionError):
    """The server at the URL never answered this process: nothing to wait for (one-line message)."""


def redacted(url: str) -> str:
    """`url` with its password, if any, replaced by ***."""
    return re.sub(r"^([a-z]+://[^:/@]*:)[^@]*@", r"\1***@", url)


class ReconnectingRedis:
    """`call(fn)` runs `fn(client)`; on a transient error it sleeps (50 ms doubling to 1 s) and runs it again
    on a fresh connection, until `retry_timeout_s` has passed since the first failure, then re-raises.
    `reconnects` counts the outages survived. `fn` must be safe to repeat (the callers' are idempotent or
    de-duplicated downstream). Before any command of this process has reached the URL, a transient error
    raises RedisUnreachableError instead of retrying."""

    def __init__(self, url: str, *, retry_timeout_s: float = 120.0, socket_timeout_s: float = 30.0):
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be a redis://, rediss:// or unix:// URL, got {url!r}")
        if retry_timeout_s < 0:
            raise ValueError(f"retry_timeout_s must be >= 0, got {retry_timeout_s}")
        self.url = url
        self.retry_timeout_s = float(retry_timeout_s)
        # our own retry loop replaces redis-py's (which would re-send a command once, without a deadline)
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=5.0, retry=Retry(NoBackoff(), 0)
        )
        self.reconnects = 0

    def call(self, fn: Callable[[redis.Redis], T], what: str = "redis command") -> T:
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                result = fn(self.client)
            except TRANSIENT_ERRORS as exc:
                if self.url not in _REACHED:
                    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    raise RedisUnreachableError(f"cannot reach Redis at {redacted(self.url)} ({reason})") from exc
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.retry_timeout_s
                    log.warning("%s failed (%s: %s); retrying until Redis is back", what, type(exc).__name__, exc)
                if now >= deadline:
                    raise
                self.client.connection_pool.disconnect()
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            _REACHED.add(self.url)
            if deadline is not None:
                self.reconnects += 1
                log.info("%s succeeded after reconnecting to %s", what, redacted(self.url))
            return result

    def ping(self) -> None:
        """Reach the server now (RedisUnreachableError if this process never has and it does not answer)."""
        self.call(lambda c: c.ping(), "PING")

    def close(self) -> None:
        self.client.close()


def ensure_group(conn: ReconnectingRedis, stream: str, group: str) -> None:
    """Create consumer group `group` on `stream` (and the stream) if missing; a no-op when it exists."""

    def create(client: redis.Redis) -> Any:
        try:
            return client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return None

    conn.call(create, "XGROUP CREATE")
