"""The lease (``jobs.lease``) against the real Redis, value by value: the TTL Redis holds after
an acquire and a renew (milliseconds, not seconds), the TTL's bounds, the fencing tokens' seed
and step, a lease never acquired or already released, and a watchdog that outlives a failed
renewal."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from services import wait_until

from jobs.constants import Keys
from jobs.lease import Lease


def _name(keys: Keys, what: str = "values") -> str:
    return keys.control_lock(what)


@pytest.mark.parametrize("ttl_s", [0, 0.0, -1.0])
def test_a_ttl_must_be_positive(redis_client: redis.Redis, keys: Keys, ttl_s: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Lease(redis_client, _name(keys), ttl_s)


def test_the_ttl_redis_holds_is_the_leases_in_milliseconds(redis_client: redis.Redis,
                                                            keys: Keys) -> None:
    lease = Lease(redis_client, _name(keys), 5.0)
    assert lease.acquire()
    assert 4000 < redis_client.pttl(lease.name) <= 5000
    redis_client.pexpire(lease.name, 1000)
    assert lease.renew()
    assert 4000 < redis_client.pttl(lease.name) <= 5000  # renewed to the full TTL, from now
    short = Lease(redis_client, _name(keys, "short"), 2.5)  # a fractional TTL: kept in ms
    assert short.acquire()
    assert 2000 < redis_client.pttl(short.name) <= 2500
    redis_client.pexpire(short.name, 1000)
    assert short.renew() and 2000 < redis_client.pttl(short.name) <= 2500


def test_a_ttl_under_a_millisecond_is_one_millisecond(redis_client: redis.Redis,
                                                      keys: Keys) -> None:
    lease = Lease(redis_client, _name(keys), 0.0001)
    assert lease.acquire() and lease.token is not None  # not a Redis error for PX 0
    assert redis_client.pttl(lease.name) in (-2, 0, 1)


def test_tokens_start_at_the_epoch_milliseconds_and_step_by_one(redis_client: redis.Redis,
                                                                 keys: Keys) -> None:
    name = _name(keys)
    before = int(time.time() * 1000)
    first = Lease(redis_client, name, 5.0)
    assert first.acquire() and first.token is not None
    after = int(time.time() * 1000)
    assert before + 1 <= first.token <= after + 1
    assert redis_client.get(name) == str(first.token)  # the key holds its holder's token
    loser = Lease(redis_client, name, 5.0)
    assert not loser.acquire() and loser.token is None  # a failed try still takes a token...
    token = first.token
    first.release()
    second = Lease(redis_client, name, 5.0)
    assert second.acquire() and second.token == token + 2  # ...so tokens never repeat


def test_a_lease_never_acquired_or_released_does_nothing(redis_client: redis.Redis,
                                                         keys: Keys) -> None:
    name = _name(keys)
    idle = Lease(redis_client, name, 5.0)
    assert not idle.renew()
    idle.release()
    holder = Lease(redis_client, name, 5.0)
    assert holder.acquire()
    assert not idle.renew()  # another's lease: neither renewed...
    idle.release()
    assert redis_client.get(name) == str(holder.token)  # ...nor freed
    holder.release()
    assert holder.token is None and redis_client.get(name) is None
    assert not holder.renew()  # released: no longer this holder's


class _Flaky(Lease):
    """A lease whose first renewal meets a Redis error (as a failover would)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.renewals = 0
        self.lock = threading.Lock()

    def renew(self) -> bool:
        with self.lock:
            self.renewals += 1
            if self.renewals == 1:
                raise redis.ConnectionError("failover")
        return super().renew()


def test_the_watchdog_keeps_renewing_after_a_failed_renewal(redis_client: redis.Redis,
                                                            keys: Keys) -> None:
    lease = _Flaky(redis_client, _name(keys), 1.5)
    with lease.kept() as mine:
        assert mine
        wait_until(lambda: lease.renewals >= 3, 30, 0.05, what="two renewals after the error")
        assert redis_client.get(lease.name) == str(lease.token)
        assert redis_client.pttl(lease.name) > 0
    assert redis_client.get(lease.name) is None  # released at the end
