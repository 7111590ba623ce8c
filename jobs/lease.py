"""The one lease primitive: a named lease in Redis, held by one holder at a time for a TTL,
renewed by that holder, released by it; the control plane's tasks, the feeders, the workers'
reconcile pass and the HTTP API's batch runner all take this one.

Every acquisition gets a fencing token, greater than every earlier token of that name: a holder
that stalled past its TTL (and lost the lease to another) can still act, so what it writes to SQL
carries its token and is refused when a newer holder's token is there (``BatchStore.fence``).
The token counter starts at the epoch milliseconds when Redis has none (a Redis restarted empty
keeps tokens growing as long as fewer than one lease a millisecond was taken before).

Invariants: the lease key holds its holder's token while it is held; ``renew`` and ``release``
act only when the key holds the caller's token (a Lua script, one round trip), so a holder whose
lease expired and went to another can neither extend nor free the new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """A write refused: its fencing token is not the newest holder's."""

_ACQUIRE = """
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], ARGV[2]) end
local token = redis.call('INCR', KEYS[2])
if redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[1]) then return token end
return false
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """The lease ``name`` for ``ttl_s`` seconds. One object is one would-be holder: after
    :meth:`acquire` returns True, ``token`` is its fencing token.

    Args:
        client: any Redis client (replies decoded or not).
        name: the lease's key; its token counter is ``<name>:fence``.
        ttl_s: how long the lease outlives its holder's last acquire or renew.
    """

    def __init__(self, client: redis.Redis, name: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a lease's ttl_s must be positive, not {ttl_s}")
        self.client, self.name, self.ttl_s = client, name, ttl_s
        self.token: int | None = None

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def acquire(self) -> bool:
        """Take the lease if nobody holds it; True if this object holds it now."""
        token = self.client.eval(_ACQUIRE, 2, self.name, f"{self.name}:fence", self._ttl_ms,
                                 int(time.time() * 1000))
        self.token = None if token is None else int(token)
        return self.token is not None

    def renew(self) -> bool:
        """Extend the lease by its TTL from now; False if it is no longer this holder's (it
        expired, and perhaps went to another)."""
        return self.token is not None and bool(
            self.client.eval(_RENEW, 1, self.name, self.token, self._ttl_ms))

    def release(self) -> None:
        """Give the lease up, if it is still this holder's."""
        if self.token is not None:
            self.client.eval(_RELEASE, 1, self.name, self.token)
            self.token = None

    @contextmanager
    def kept(self) -> Iterator[bool]:
        """``with lease.kept() as mine:`` — ``mine`` is False when another holds the lease (do
        nothing then); otherwise a watchdog thread renews it every third of its TTL until the
        block ends, then it is released: a long run keeps it, a dead process loses it within
        the TTL."""
        if not self.acquire():
            yield False
            return
        stop = threading.Event()
        watchdog = threading.Thread(target=self._keep, args=(stop,), daemon=True,
                                    name=f"lease-{self.name}")
        watchdog.start()
        try:
            yield True
        finally:
            stop.set()
            watchdog.join()
            try:
                self.release()
            except redis.RedisError as exc:  # it expires by itself
                log.warning("releasing lease %s failed: %s", self.name, exc)

    def _keep(self, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    log.error("lease %s was lost: another holder may start", self.name)
                    return
            except redis.RedisError as exc:  # keep trying while the TTL lasts
                log.warning("renewing lease %s failed: %s", self.name, exc)
