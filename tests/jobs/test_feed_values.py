"""``jobs.feed.Feeder`` value by value, with no model: how many jobs one ``feed()`` moves (the
window's room exactly, over several chunks, past a chunk of jobs that fail), what it returns,
the documented default window, the feed lock (released after a feed, respected while another
holds it), and the failed jobs announced."""

from __future__ import annotations

import json

import pytest
import redis
import sqlalchemy as sa
from services import all_roles_store

import jobs.feed
from jobs.constants import Keys
from jobs.feed import Feeder
from jobs.queue import JobQueue
from jobs.schemas import JobSpec
from jobs.store import FeedStore

SQL = all_roles_store()
MODEL = "tiny"


def _backlog(pg_engine: sa.Engine, n: int, prefix: str = "p") -> list[str]:
    specs = [JobSpec(model=MODEL, prompt=f"{prefix}{i}") for i in range(n)]
    SQL(pg_engine).insert_jobs(specs)
    return [s.id for s in specs]


def test_one_feed_fills_the_room_exactly_over_chunks(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs.feed, "FEED_CHUNK", 3)
    q = JobQueue(redis_client, MODEL, keys)
    ids = _backlog(pg_engine, 12)
    feeder = Feeder(q, FeedStore(pg_engine), min_window=8)
    assert feeder.room() == 8
    assert feeder.feed() == 8 and q.length() == 8  # chunks of 3, 3, 2
    assert q.job_ids_in_stream() <= set(ids)
    assert feeder.room() == 0 and feeder.feed() == 0
    assert redis_client.exists(keys.feed_lock(MODEL)) == 0  # released after each feed
    q.ensure_group()
    q.ack(q.read("w", 1))  # room for one
    assert feeder.room() == 1
    assert feeder.feed() == 1 and q.length() == 8
    q.ack(q.read("w", 8))
    assert feeder.feed() == 3 and q.length() == 3  # what the backlog had left
    assert FeedStore(pg_engine).backlog(MODEL) == 0 and feeder.feed() == 0


def test_another_feeder_holding_the_lock_is_respected(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    q = JobQueue(redis_client, MODEL, keys)
    _backlog(pg_engine, 3)
    redis_client.set(keys.feed_lock(MODEL), "999", px=60_000)
    assert Feeder(q, FeedStore(pg_engine), min_window=8).feed() == 0 and q.length() == 0
    redis_client.delete(keys.feed_lock(MODEL))
    assert Feeder(q, FeedStore(pg_engine), min_window=8).feed() == 3 and q.length() == 3


def test_jobs_that_fail_do_not_stop_the_feed(redis_client: redis.Redis, keys: Keys,
                                             pg_engine: sa.Engine) -> None:
    """A chunk of stored jobs today's rules refuse: they fail (announced), and the same feed
    goes on to the next jobs."""
    q = JobQueue(redis_client, MODEL, keys)
    old = _backlog(pg_engine, 4, prefix="old")  # older: taken first
    good = _backlog(pg_engine, 4, prefix="good")
    specs = {s.id: s for s in SQL(pg_engine).specs(old)[0]}
    with pg_engine.begin() as conn:  # as an older kvbatch stored them: a top_k now refused
        for job_id in old:
            spec = {**specs[job_id].model_dump(mode="json"), "sampling": {"top_k": 2**40}}
            conn.execute(sa.text("UPDATE jobs SET spec = :spec WHERE id = :id"),
                         {"spec": json.dumps(spec), "id": job_id})
    feeder = Feeder(q, FeedStore(pg_engine), min_window=4)
    assert feeder.feed() == 4
    assert q.job_ids_in_stream() == set(good)
    for job_id in old:
        assert SQL(pg_engine).get(job_id).status.value == "failed"
        assert redis_client.get(keys.done(job_id)) == "failed"
    for job_id in good:
        assert redis_client.get(keys.done(job_id)) is None


def test_the_default_window_is_the_documented_256(redis_client: redis.Redis, keys: Keys,
                                                  pg_engine: sa.Engine) -> None:
    """docs/queue.md: with no live worker the stream holds ``MIN_WINDOW`` (256) entries."""
    q = JobQueue(redis_client, MODEL, keys)
    _backlog(pg_engine, 300)
    assert Feeder(q, FeedStore(pg_engine)).feed() == 256 and q.length() == 256
