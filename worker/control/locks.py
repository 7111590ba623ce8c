"""Task locks: one run of a task (or of one batch's finalization) at a time across control
processes, however long the run takes.

A Redis lock with a short TTL, renewed by a watchdog thread every third of it while the run
lasts: a long run (exporting a large batch) keeps it, a dead process loses it within the TTL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import LockError

log = logging.getLogger(__name__)


@contextmanager
def held(client: redis.Redis, name: str, ttl_s: float) -> Iterator[bool]:
    """``with held(client, name, ttl_s) as mine:`` — ``mine`` is False when another run holds
    the lock (do nothing then); otherwise the lock is kept until the block ends."""
    # thread_local=False: the watchdog thread renews with the token this thread acquired.
    lock = client.lock(name, timeout=ttl_s, blocking=False, thread_local=False)
    if not lock.acquire():
        yield False
        return
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                lock.reacquire()
            except LockError:
                log.error("lock %s was lost: another run may start", name)
                return
            except redis.RedisError as exc:  # keep trying while the TTL lasts
                log.warning("renewing lock %s failed: %s", name, exc)

    watchdog = threading.Thread(target=renew, name=f"lock-{name}", daemon=True)
    watchdog.start()
    try:
        yield True
    finally:
        stop.set()
        watchdog.join()
        try:
            lock.release()
        except LockError:  # expired (Redis unreachable for a whole TTL): nothing to release
            log.warning("lock %s had expired before its run ended", name)
