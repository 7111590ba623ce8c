from __future__ import annotations

import json
import time

import redis
import sqlalchemy as sa
from services import all_roles_store

from jobs.client import JobClient
from jobs.constants import CONSUMER_GROUP, Keys
from jobs.queue import JobQueue
from jobs.reconcile import reconcile
from jobs.schemas import JobSpec, JobStatus
from jobs.store import Decision

SQL = all_roles_store()


def _specs(n: int, model: str = "m") -> list[JobSpec]:
    return [JobSpec(model=model, prompt=f"p{i}") for i in range(n)]


def _consumers(redis_client: redis.Redis, q: JobQueue) -> set[str]:
    """The consumers of the model's group, in any bucket's stream."""
    return {c["name"] for stream in q.streams
            for c in redis_client.xinfo_consumers(stream, CONSUMER_GROUP)}


def test_pull_is_bounded_by_count_and_ack_deletes(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    specs = _specs(5)
    q.enqueue(specs)
    assert q.depth() == (5, 0)
    got = q.read("w1", count=3)
    assert [d.job_id for d in got] == [s.id for s in specs[:3]]
    assert q.depth() == (2, 3)
    q.ack(got)
    assert q.depth() == (2, 0)
    assert q.job_ids_in_stream() == {s.id for s in specs[3:]}
    assert q.read("w1", count=0) == []


def test_orphans_of_dead_worker_are_claimed_and_live_ones_never(
    redis_client: redis.Redis, keys: Keys
) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    q.enqueue(_specs(4))
    for w in ("dead", "slow", "claimer", "rival"):
        q.heartbeat(w, lease_ttl_ms=1500 if w == "dead" else 60_000)
    held_dead = q.read("dead", count=3)
    held_slow = q.read("slow", count=1)
    assert q.claim_orphans("claimer", count=10, min_idle_ms=100) == []  # everyone alive
    time.sleep(1.6)  # "dead" stops heartbeating; its lease expires
    # The four jobs lie in four buckets' streams (entry ids are only unique within a stream;
    # the same id in several streams when one millisecond enqueued them), claimed stream by
    # stream: which two of the dead worker's three come first is the buckets' order.
    dead_entries = {(d.stream, d.entry_id) for d in held_dead}
    assert len({d.stream for d in held_dead}) == 3
    claimed = q.claim_orphans("claimer", count=2, min_idle_ms=100)
    assert len(claimed) == 2 and {(d.stream, d.entry_id) for d in claimed} < dead_entries
    # A rival claiming right after gets nothing of what was just claimed (idle reset)...
    rest = q.claim_orphans("rival", count=10, min_idle_ms=100)
    assert {(d.stream, d.entry_id) for d in [*claimed, *rest]} == dead_entries
    assert len(rest) == 1
    # ...and the slow-but-alive worker keeps its job.
    pending = redis_client.xpending_range(held_slow[0].stream, CONSUMER_GROUP, "-", "+", 10)
    owners = {p["message_id"]: p["consumer"] for p in pending}
    assert owners[held_slow[0].entry_id] == "slow"
    # The next pass removes the dead consumer, which holds nothing any more.
    assert q.claim_orphans("claimer", count=10, min_idle_ms=100) == []
    assert "dead" not in _consumers(redis_client, q)
    assert q.live_workers() >= {"slow", "claimer", "rival"}


def test_dead_letter_stream_keeps_payload_and_reason(redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    redis_client.xadd(q.streams[0], {"garbage": "1"})
    (d,) = q.read("w", 1)
    assert d.job_id is None
    q.dead_letter([d], ["malformed message: no job id"])
    assert q.depth() == (0, 0)
    ((_, fields),) = redis_client.xrange(keys.dead_letter("m"))
    assert fields["reason"] == "malformed message: no job id"


def test_submit_is_durable_and_reconciler_restores_lost_stream(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine
) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit(_specs(4))
    q = JobQueue(redis_client, "m", keys)
    assert q.job_ids_in_stream() == set(ids)
    # Worker w1 (alive) runs ids[0]; worker w2 (dead) ran ids[1].
    q.heartbeat("w1", 10_000)
    SQL(client.engine).begin_deliveries([ids[0]], "w1", 3, time.time())
    SQL(client.engine).begin_deliveries([ids[1]], "w2", 3, time.time())
    redis_client.delete(*q.streams)  # Redis lost its data

    report = reconcile(SQL(client.engine), q, grace_s=0.0)
    assert sorted(report.requeued) == sorted(ids[1:])
    assert q.job_ids_in_stream() == set(ids[1:])
    assert reconcile(SQL(client.engine), q, grace_s=0.0).requeued == []  # nothing missing now
    # Jobs younger than the grace period may still be on their way to the stream.
    redis_client.delete(*q.streams)
    assert reconcile(SQL(client.engine), q, grace_s=3600).requeued == []


def test_cancel_queued_and_running(redis_client: redis.Redis, keys: Keys,
                                   pg_engine: sa.Engine) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    a, b = client.submit(_specs(2))
    assert client.cancel(a) is JobStatus.CANCELLED
    assert client.wait([a], timeout_s=1)[0].status is JobStatus.CANCELLED
    assert SQL(client.engine).begin_deliveries([b], "w", 3, time.time()) == {b: Decision.RUN}
    assert client.cancel(b) is JobStatus.RUNNING
    q = JobQueue(redis_client, "m", keys)
    assert q.cancel_requested([a, b]) == [b]


def test_reconciler_fails_stored_jobs_that_no_longer_validate(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    """A job stored by an older kvbatch that today's rules refuse fails, with why, instead of
    stopping the pass or staying queued forever."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    good, old = JobSpec(model="m", prompt="fine"), JobSpec(model="m", prompt="old")
    SQL(client.engine).insert_jobs([good, old], fed=["m"])  # fed, their XADD lost
    with pg_engine.begin() as conn:  # as an older kvbatch stored it: a top_k now refused
        spec = {**old.model_dump(mode="json"), "sampling": {"top_k": 2**40}}
        conn.execute(sa.text("UPDATE jobs SET spec = :spec WHERE id = :id"),
                     {"spec": json.dumps(spec), "id": old.id})
    q = JobQueue(redis_client, "m", keys)
    report = reconcile(SQL(client.engine), q, grace_s=0.0)
    assert report.requeued == [good.id]
    info = client.get(old.id)
    assert info is not None and info.status is JobStatus.FAILED
    assert info.error.startswith("stored job no longer valid:") and "top_k" in info.error


def test_reads_across_buckets_follow_arrival_not_job_age(redis_client: redis.Redis,
                                                         keys: Keys) -> None:
    """The feeder hands a big batch's older jobs over after a small batch's newer one: the
    small one must not wait behind every refill (the buckets are read in arrival order)."""
    q = JobQueue(redis_client, "m", keys)
    big = _specs(100)  # older ids
    small = JobSpec(model="m", prompt="a small batch's row")
    q.enqueue(big[:50])
    q.enqueue([small])
    q.enqueue(big[50:])
    got = q.read("w", count=101)
    assert len({d.stream for d in got}) > 10  # spread over buckets
    assert [d.job_id for d in got] == [s.id for s in big[:50]] + [small.id] + [
        s.id for s in big[50:]]


def test_reconciler_grace_ignores_a_skewed_client_clock(
    redis_client: redis.Redis, keys: Keys, sql_engine: sa.Engine,
) -> None:
    store = SQL(sql_engine)
    q = JobQueue(redis_client, "m", keys)
    spec = JobSpec(model="m", prompt="p", submitted_at=time.time() - 3600)  # clock 1 h behind
    store.insert_jobs([spec])  # its XADD has not happened yet
    assert reconcile(store, q, grace_s=60).requeued == []
    created = store.get(spec.id).created_at.timestamp()
    assert abs(created - time.time()) < 5


def test_cancel_of_queued_job_publishes_and_expires_marker(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.done_channel())
    (job_id,) = client.submit([JobSpec(model="m", prompt="a")])
    assert client.cancel(job_id) is JobStatus.CANCELLED
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
    pubsub.close()
    assert message is not None and json.loads(message["data"]) == {"id": job_id,
                                                                  "status": "cancelled"}
    assert 0 < redis_client.ttl(keys.done(job_id)) <= 24 * 3600


def test_registry_of_workers_is_pruned(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    for name in ("gone-1", "gone-2", "alive"):
        q.heartbeat(name, 60_000)
    redis_client.delete(keys.heartbeat("gone-1"), keys.heartbeat("gone-2"))
    assert q.live_workers() == {"alive"}
    assert set(redis_client.hkeys(keys.workers())) == {"alive"}
    # A dead consumer with nothing pending leaves the group and the registry.
    q.enqueue([JobSpec(model="m", prompt="p")])
    q.ack(q.read("gone-1", 1))
    q.heartbeat("gone-1", 60_000)
    redis_client.delete(keys.heartbeat("gone-1"))
    q.claim_orphans("alive", 10, min_idle_ms=0)
    consumers = {c["name"] for stream in q.streams
                 for c in redis_client.xinfo_consumers(stream, CONSUMER_GROUP)}
    assert "gone-1" not in consumers and set(redis_client.hkeys(keys.workers())) == {"alive"}
