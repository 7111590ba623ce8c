"""``worker.maintenance.UpkeepThread`` value by value, with no model: the reconcile lock (one
pass per interval over all the workers, none while another holds it), the expired jobs counted
in the worker's metrics as expired, and the thread itself: a reconcile and a backlog count at
start, feeding, a wake, a stop."""

from __future__ import annotations

import redis
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from services import all_roles_store, wait_until

from jobs.constants import Keys
from jobs.feed import Feeder
from jobs.queue import JobQueue
from jobs.schemas import JobSpec
from jobs.store import FeedStore
from worker.maintenance import UpkeepThread
from worker.metrics import WorkerMetrics

SQL = all_roles_store()
MODEL = "tiny"


def _stored(pg_engine: sa.Engine, n: int, fed: bool) -> list[str]:
    specs = [JobSpec(model=MODEL, prompt=f"p{i}") for i in range(n)]
    SQL(pg_engine).insert_jobs(specs, fed=[MODEL] if fed else [])
    return [s.id for s in specs]


def _past_deadline(pg_engine: sa.Engine, ids: list[str]) -> None:
    with pg_engine.begin() as conn:
        for job_id in ids:
            conn.execute(sa.text("UPDATE jobs SET deadline_at = now() - interval '1 minute' "
                                 "WHERE id = :id"), {"id": job_id})


def _upkeep(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
            interval_s: float = 600.0, min_window: int = 256,
            grace_s: float = 0.0):  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    q = JobQueue(redis_client, MODEL, keys)
    upkeep = UpkeepThread(Feeder(q, FeedStore(pg_engine), min_window=min_window),
                          SQL(pg_engine), interval_s, grace_s, WorkerMetrics(MODEL, registry))
    return upkeep, registry, q


def _finished(registry: CollectorRegistry, status: str) -> float:
    return registry.get_sample_value("kvbatch_jobs_total",
                                     {"model_name": MODEL, "status": status}) or 0.0


def test_one_reconcile_per_interval_and_expiries_counted(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    upkeep, registry, q = _upkeep(redis_client, keys, pg_engine, interval_s=600.0)
    other, _, _ = _upkeep(redis_client, keys, pg_engine, interval_s=600.0)
    expired = _stored(pg_engine, 3, fed=True)
    lost = _stored(pg_engine, 2, fed=True)  # fed, not in the stream: requeued, not counted
    _past_deadline(pg_engine, expired)
    upkeep.reconcile_once()
    assert _finished(registry, "expired") == 3.0
    assert {s: _finished(registry, s) for s in ("succeeded", "failed", "cancelled")} == {
        "succeeded": 0.0, "failed": 0.0, "cancelled": 0.0}
    assert q.job_ids_in_stream() == set(lost)
    # The lock is held for the interval, not released: no other pass runs meanwhile.
    ttl = redis_client.pttl(keys.reconcile_lock(MODEL))
    assert 500_000 < ttl <= 600_000
    later = _stored(pg_engine, 1, fed=True)
    _past_deadline(pg_engine, later)
    redis_client.delete(*q.streams)
    other.reconcile_once()
    upkeep.reconcile_once()
    assert q.job_ids_in_stream() == set() and _finished(registry, "expired") == 3.0
    # Once it lapses, the next pass runs.
    redis_client.delete(keys.reconcile_lock(MODEL))
    upkeep.reconcile_once()
    assert _finished(registry, "expired") == 4.0 and q.job_ids_in_stream() == set(lost)


def test_the_thread_reconciles_feeds_counts_and_stops(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    upkeep, registry, q = _upkeep(redis_client, keys, pg_engine, interval_s=600.0,
                                  min_window=4)
    expired = _stored(pg_engine, 2, fed=True)
    _past_deadline(pg_engine, expired)
    backlog = _stored(pg_engine, 10, fed=False)

    def gauge() -> float | None:
        return registry.get_sample_value("kvbatch_queue_backlog", {"model_name": MODEL})

    upkeep.start()
    try:
        # At start: a reconcile pass, a feed of the window, a count of what is left.
        wait_until(lambda: q.length() == 4 and gauge() == 6.0, 60, what="the first pass")
        assert _finished(registry, "expired") == 2.0
        assert q.job_ids_in_stream() <= set(backlog)
        # The stream loses entries: a wake feeds it again.
        q.ensure_group()
        q.ack(q.read("w", 2))  # pulled and done: two entries gone
        upkeep.wake()
        wait_until(lambda: q.length() == 4, 60, what="a refill after a wake")
        assert FeedStore(pg_engine).backlog(MODEL) < 6
    finally:
        upkeep.stop()
        upkeep._thread.join(30)
    assert not upkeep._thread.is_alive()


def test_the_grace_is_the_reconcilers(redis_client: redis.Redis, keys: Keys,
                                      pg_engine: sa.Engine) -> None:
    """Jobs fed within the grace may not have reached the stream yet: left alone."""
    upkeep, _, q = _upkeep(redis_client, keys, pg_engine, grace_s=600.0)
    _stored(pg_engine, 2, fed=True)
    upkeep.reconcile_once()
    assert q.job_ids_in_stream() == set()


def test_a_failing_pass_does_not_end_the_thread(redis_client: redis.Redis, keys: Keys,
                                                pg_engine: sa.Engine,
                                                monkeypatch) -> None:  # type: ignore[no-untyped-def]
    upkeep, _, q = _upkeep(redis_client, keys, pg_engine, min_window=4)
    calls = []

    def broken_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in one pass")
        return 0

    monkeypatch.setattr(upkeep.feeder.store, "backlog", broken_once)
    backlog = _stored(pg_engine, 6, fed=False)
    upkeep.start()
    try:
        wait_until(lambda: q.length() == 4, 60, what="a first feed")
        q.ensure_group()
        q.ack(q.read("w", 4))  # the first pass failed after its feed: the thread goes on
        upkeep.wake()
        wait_until(lambda: q.length() == 2, 60, what="a feed after the failed pass")
        assert upkeep._thread.is_alive() and len(calls) >= 1
        assert FeedStore(pg_engine).backlog(MODEL) == 0 and len(backlog) == 6
    finally:
        upkeep.stop()
        upkeep._thread.join(30)
