"""Retry pacing and error text shared by the worker's modules."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.1  # first retry after 0.2 s, doubling
MAX_BACKOFF_S = 10.0


@dataclass
class Backoff:
    """Exponential backoff after consecutive failures, capped at :data:`MAX_BACKOFF_S`."""

    failures: int = 0
    retry_at: float = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.retry_at

    def failed(self, now: float) -> None:
        self.failures += 1
        self.retry_at = now + min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2 ** self.failures)

    def ok(self) -> None:
        self.failures, self.retry_at = 0, 0.0


class RedisBackoff:
    """The worker's one backoff for Redis, shared by the loop (its pull, its sends) and the
    result writer (its sends): they talk to one server, so a failure on either thread holds
    both back. Safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backoff = Backoff()

    def ready(self, now: float) -> bool:
        with self._lock:
            return self._backoff.ready(now)

    def reset(self) -> None:
        with self._lock:
            self._backoff.ok()

    def call(self, now: float, step: Callable[[], object]) -> None:
        """Run ``step`` unless backing off; a ``redis.RedisError`` from it is logged and
        starts (or lengthens) the backoff, a success ends it."""
        if not self.ready(now):
            return
        try:
            step()
        except redis.RedisError as exc:
            with self._lock:
                self._backoff.failed(now)
                retry_in_s = self._backoff.retry_at - now
            log.warning("redis unavailable (%s); retrying in %.1fs", exc, retry_in_s)
            return
        self.reset()


def is_outage(exc: SQLAlchemyError) -> bool:
    """Anything but a refusal of this particular data (``DataError``: a value out of range or
    too long; ``IntegrityError``): a database that is down, restarting or too slow, but also a
    schema that is missing or wrong. Those are retried, never given up on, since giving up
    acknowledges the job."""
    return not isinstance(exc, DataError | IntegrityError)


def short_error(exc: BaseException, limit: int = 500) -> str:
    """The first lines of an exception's text, at most ``limit`` characters."""
    text = str(exc).strip().splitlines()
    line = " ".join(text[:3]) if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
