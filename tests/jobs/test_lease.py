"""The one lease (``jobs.lease``) against the real Redis and SQL: one holder at a time; it
expires when not renewed and is kept while renewed (by hand or by the watchdog of ``kept``); a
holder whose lease went to another can neither renew nor release the new one; its fencing
tokens only grow, also after Redis lost the counter; and SQL refuses the writes of a stale
token (``BatchStore.fence``, ``ProducerStore.insert_jobs``) on PostgreSQL and SQLite."""

from __future__ import annotations

import time

import pytest
import redis
from sqlalchemy import Engine

from jobs.constants import Keys
from jobs.lease import Lease, LeaseLost
from jobs.schemas import JobSpec
from jobs.store import BatchStore, ProducerStore


# TTLs of a second by default, 2 s where a lease is renewed (by hand every quarter TTL, by the
# watchdog every third), so that a renewal a second late on a loaded 2-core machine is still in
# time.
def _lease(redis_client: redis.Redis, keys: Keys, ttl_s: float = 1.0) -> Lease:
    return Lease(redis_client, keys.control_lock("test"), ttl_s)


def test_one_holder_until_it_expires(redis_client: redis.Redis, keys: Keys) -> None:
    first, second = _lease(redis_client, keys), _lease(redis_client, keys)
    assert first.acquire() and not second.acquire()
    assert second.token is None
    time.sleep(1.2)  # never renewed: it runs out
    assert second.acquire()
    assert first.token is not None and second.token is not None
    assert second.token > first.token


def test_renewal_keeps_it_and_release_frees_it(redis_client: redis.Redis, keys: Keys) -> None:
    holder, other = _lease(redis_client, keys, 2.0), _lease(redis_client, keys)
    assert holder.acquire()
    for _ in range(8):  # 4 s in all, twice the TTL
        time.sleep(0.5)
        assert holder.renew()
    assert not other.acquire()
    holder.release()
    assert other.acquire()


def test_a_stale_holder_neither_renews_nor_frees_the_new_one(redis_client: redis.Redis,
                                                              keys: Keys) -> None:
    stale, new = _lease(redis_client, keys, 0.1), _lease(redis_client, keys, 5.0)
    assert stale.acquire()
    time.sleep(0.2)
    assert new.acquire()
    assert not stale.renew()
    stale.release()
    assert redis_client.get(new.name) == str(new.token)  # still the new holder's
    assert not _lease(redis_client, keys).acquire()


def test_kept_renews_while_the_block_runs(redis_client: redis.Redis, keys: Keys) -> None:
    with _lease(redis_client, keys, 2.0).kept() as mine:
        assert mine
        time.sleep(5.0)  # well past the TTL: the watchdog renewed it
        with _lease(redis_client, keys).kept() as theirs:
            assert not theirs
    assert _lease(redis_client, keys).acquire()  # released at the end


def test_tokens_grow_after_redis_lost_the_counter(redis_client: redis.Redis,
                                                  keys: Keys) -> None:
    first = _lease(redis_client, keys)
    assert first.acquire() and first.token is not None
    token = first.token
    first.release()
    redis_client.delete(f"{first.name}:fence")  # as a Redis restarted empty would
    time.sleep(0.01)  # a restart takes longer than a lease a millisecond
    again = _lease(redis_client, keys)
    assert again.acquire() and again.token is not None
    assert again.token > token


def test_sql_refuses_a_stale_token(sql_engine: Engine, redis_client: redis.Redis,
                                   keys: Keys) -> None:
    batches, producer = BatchStore(sql_engine), ProducerStore(sql_engine)
    batches.create("b", 3600)
    stale, new = _lease(redis_client, keys, 0.1), _lease(redis_client, keys, 5.0)
    assert stale.acquire() and stale.token is not None
    assert batches.fence("b", stale.token)
    time.sleep(0.2)
    assert new.acquire() and new.token is not None
    assert batches.fence("b", new.token)
    assert not batches.fence("b", stale.token)  # an older token never becomes the newest
    spec = JobSpec(id="j1", batch_id="b", custom_id="r1", model="m", prompt="p")
    with pytest.raises(LeaseLost):
        producer.insert_jobs([spec], fence=stale.token)
    assert not batches.start("b", "m", stale.token)
    producer.insert_jobs([spec], fence=new.token)
    assert batches.start("b", "m", new.token)
    assert str(batches.status("b")) == "in_progress"
