"""Every delivery is acknowledged once its job's outcome is stored, the first time or not: a
duplicate (a second stream entry of the job, or its entry claimed by a second worker after the
first stored the outcome and died before acking) must leave the consumer group's pending list
too, or it stays there forever. Checked on XPENDING, right after the store."""

from __future__ import annotations

import time

import pytest
import redis
import sqlalchemy as sa
from services import all_roles_store

from jobs.client import JobClient
from jobs.constants import CONSUMER_GROUP, Keys
from jobs.queue import Delivery, JobQueue
from jobs.schemas import JobSpec, JobStatus, Outcome
from jobs.store import DeliveryStore
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.persist import ResultWriter
from worker.retry import RedisBackoff

SQL = all_roles_store()
MODEL = "tiny"


def _pending(client: redis.Redis, q: JobQueue) -> int:
    """Entries delivered and not acknowledged, over the model's streams (XPENDING)."""
    return sum(int(client.xpending(s, CONSUMER_GROUP)["pending"]) for s in q.streams
               if client.exists(s))


def _entries(client: redis.Redis, q: JobQueue) -> int:
    return sum(int(client.xlen(s)) for s in q.streams)


def _writer(pg_engine: sa.Engine, worker_id: str, q: JobQueue) -> ResultWriter:
    # Its thread is not started: flush() is one pass, run here.
    return ResultWriter(DeliveryStore(pg_engine), worker_id, Outbox(q), RedisBackoff(),
                        WorkerMetrics(MODEL))


def _succeeded(job_id: str) -> Outcome:
    return Outcome(job_id, JobStatus.SUCCEEDED, time.time())


@pytest.mark.parametrize("duplicate", ["second-entry", "claimed-after-crash"])
def test_a_duplicate_outcome_is_acked_though_not_stored(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, duplicate: str) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    spec = JobSpec(model=MODEL, prompt="hello", sampling={"max_tokens": 2})
    client.submit([spec])
    q = JobQueue(redis_client, MODEL, keys)
    q.ensure_group()
    (first,) = q.read("w1", 10)
    store = DeliveryStore(pg_engine)
    store.begin_deliveries([spec.id], "w1", max_deliveries=3, now_s=time.time())
    if duplicate == "second-entry":
        # A second copy of the job in the stream (a reconciler re-enqueue), run by w2 while
        # w1 runs the first: w1 stores and acks its own, then w2 stores a duplicate.
        q.enqueue([spec])
        (second,) = q.read("w2", 10)
        assert second.entry_id != first.entry_id
        w1 = _writer(pg_engine, "w1", q)
        w1.add(_succeeded(spec.id), first)
        w1.flush()
        assert _pending(redis_client, q) == 1
    else:
        # w1 stored the outcome and died before acking; w2 claims the entry and runs it again.
        assert store.finish([_succeeded(spec.id)], worker_id="w1") == {spec.id}
        (second,) = q.claim("w2", [(first.stream, first.entry_id)])[0]
        assert second.entry_id == first.entry_id
    w2 = _writer(pg_engine, "w2", q)
    w2.add(_succeeded(spec.id), second)
    w2.flush()
    assert (_pending(redis_client, q), _entries(redis_client, q)) == (0, 0)
    assert not w2.outbox  # nothing owed
    (info,) = client.get_many([spec.id])
    assert info.status is JobStatus.SUCCEEDED and info.worker_id == "w1"


def test_every_outcome_of_a_flush_is_acked(redis_client: redis.Redis, keys: Keys,
                                           pg_engine: sa.Engine) -> None:
    """New outcomes and duplicates in one transaction: all their entries leave."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    specs = [JobSpec(model=MODEL, prompt=f"job {i}") for i in range(4)]
    client.submit(specs)
    q = JobQueue(redis_client, MODEL, keys)
    q.ensure_group()
    q.enqueue(specs[:2])  # second copies of two of them
    deliveries: list[Delivery] = q.read("w1", 100)
    assert len(deliveries) == 6 and _pending(redis_client, q) == 6
    DeliveryStore(pg_engine).begin_deliveries([s.id for s in specs], "w1", 3, time.time())
    writer = _writer(pg_engine, "w1", q)
    for d in deliveries:
        assert d.job_id is not None
        writer.add(_succeeded(d.job_id), d)
    writer.flush()
    assert (_pending(redis_client, q), _entries(redis_client, q)) == (0, 0)


def test_a_worker_acks_what_it_stored_and_the_copies_it_skipped(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker,
        wait_for) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    q = JobQueue(redis_client, MODEL, keys)
    greedy = {"temperature": 0.0, "max_tokens": 2}
    specs = [JobSpec(model=MODEL, prompt=f"job {i}", sampling=greedy) for i in range(3)]
    client.submit(specs)
    q.enqueue(specs[:1])  # a copy pulled with the first: skipped at intake while it is held
    start_worker()
    client.wait([s.id for s in specs], timeout_s=60)
    # The acks follow the store at once; the ceiling only catches an ack that never comes.
    wait_for(lambda: (_pending(redis_client, q), _entries(redis_client, q)) == (0, 0), 10)
    # A copy of a finished job: decided SKIP at intake, acked, not run again.
    q.enqueue(specs[1:2])
    wait_for(lambda: (_pending(redis_client, q), _entries(redis_client, q)) == (0, 0), 10)
    infos = client.get_many([s.id for s in specs])
    assert [(i.status, i.attempts) for i in infos] == [(JobStatus.SUCCEEDED, 1)] * 3
