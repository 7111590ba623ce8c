"""Regression tests for the queue/worker review (letters refer to the review's findings):
each fails on the code before its fix."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
import sqlalchemy as sa
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry
from services import all_roles_store

from jobs.client import JobClient
from jobs.constants import CONSUMER_GROUP, MAX_PAYLOAD_BYTES, Keys
from jobs.queue import JobQueue
from jobs.reconcile import reconcile
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome, decode_job
from jobs.store import Decision
from worker.heartbeat import Heartbeat
from worker.outbox import Outbox

SQL = all_roles_store()

MODEL = "tiny"


def _long(i: int, max_tokens: int) -> JobSpec:
    return JobSpec(model=MODEL, prompt=f"job {i}",
                   sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})


def _bare_worker(tiny_model: str, keys: Keys, pg_url: str, pg_engine: sa.Engine,
                 redis_client: redis.Redis, **overrides):  # type: ignore[no-untyped-def]
    """A Worker whose loop and engine thread are not started: its parts are driven by hand."""
    from worker_harness import worker_settings

    from worker.loop import Worker

    settings = worker_settings(tiny_model, keys, pg_url, **overrides)
    return Worker(settings, llm=None, redis_client=redis_client, db=pg_engine)


# -- A: a worker restarted under the same id takes back what its last process held ------------

def test_restart_with_same_worker_id_takes_back_its_pending_jobs(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_long(i, max_tokens=8) for i in range(3)])
    q = JobQueue(redis_client, MODEL, keys)
    # The previous process of worker "same" pulled and started them, then died (no drain).
    got = q.read("same", count=10)
    assert sorted(d.job_id for d in got) == sorted(ids)
    SQL(client.engine).begin_deliveries(ids, "same", 3, time.time())
    start_worker(worker_id="same")
    infos = client.wait(ids, timeout_s=30)
    assert [(i.status, i.attempts, i.worker_id) for i in infos] == [
        (JobStatus.SUCCEEDED, 2, "same")] * 3
    assert q.depth() == (0, 0)


# -- B: the lease is renewed while the loop is stuck in a slow database call ------------------

def test_lease_survives_a_stalled_loop(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_long(i, max_tokens=1900) for i in range(2)])
    running = start_worker(lease_ttl_s=1.5)
    wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING})
    blocker = JobSpec(model=MODEL, prompt="locked")
    SQL(client.engine).insert_jobs([blocker])
    with pg_engine.connect() as conn, conn.begin():
        # The worker's decision on this job waits for our row lock: its loop stalls 4 s.
        conn.execute(sa.text("SELECT id FROM jobs WHERE id = :id FOR UPDATE"),
                     {"id": blocker.id})
        JobQueue(redis_client, MODEL, keys).enqueue([blocker])
        time.sleep(4.0)
        thief = JobQueue(redis_client, MODEL, keys)
        assert running.worker.worker_id in thief.live_workers()
        assert thief.claim_orphans("thief", 100, min_idle_ms=0) == []
    (info,) = client.wait([blocker.id], timeout_s=30)
    assert info.status is JobStatus.SUCCEEDED
    client.cancel(ids[0]), client.cancel(ids[1])


def test_heartbeat_lapses_when_the_loop_is_stuck(redis_client: redis.Redis, keys: Keys,
                                                 wait_for) -> None:  # type: ignore[no-untyped-def]
    q = JobQueue(redis_client, MODEL, keys)
    beat = Heartbeat(q, "stuck", lease_ttl_s=0.6, stall_s=0.5, window=10)
    beat.start()
    try:
        time.sleep(0.3)
        assert q.live_workers() == {"stuck"}
        wait_for(lambda: not q.live_workers(), timeout_s=3)  # no progress: no renewal
    finally:
        beat.stop()


# -- C: a copy of a job running on a live worker neither runs nor counts ----------------------

def test_copy_of_job_running_on_live_worker_is_skipped(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    spec = JobSpec(model="m", prompt="p")
    store.insert_jobs([spec])
    now = time.time()
    assert store.begin_deliveries([spec.id], "w1", 2, now) == {spec.id: Decision.RUN}
    for _ in range(3):  # stolen-lease or reconciler copies while w1 is alive
        assert store.begin_deliveries([spec.id], "w2", 2, now, live_workers={"w1", "w2"}) == {
            spec.id: Decision.SKIP}
    (info,) = store.get_many([spec.id])
    assert (info.status, info.attempts, info.worker_id) == (JobStatus.RUNNING, 1, "w1")
    # w1 is gone: the next delivery takes the job over.
    assert store.begin_deliveries([spec.id], "w2", 2, now, live_workers={"w2"}) == {
        spec.id: Decision.RUN}
    assert store.get(spec.id).worker_id == "w2"


# -- D: the reconciler's grace runs on the database's clock, not the client's -----------------

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


# -- E: owed acks, dead letters and notices survive a Redis failure ---------------------------

def test_outbox_keeps_what_redis_did_not_take(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    specs = [JobSpec(model="m", prompt=f"p{i}") for i in range(2)]
    q.enqueue(specs)
    ok, bad = q.read("w", count=2)
    down = redis.Redis(host="127.0.0.1", port=1, decode_responses=True,  # nothing listens
                       socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    outbox = Outbox(JobQueue(down, "m", keys))
    outbox.ack([ok])
    outbox.dead_letter(bad, "unreadable")
    outbox.notify(ok.job_id, "succeeded")
    with pytest.raises(redis.ConnectionError):
        outbox.flush()
    assert outbox and q.depth() == (0, 2)
    outbox.queue = q  # Redis is back
    outbox.flush()
    assert not outbox and q.depth() == (0, 0)
    assert [f["reason"] for _, f in redis_client.xrange(keys.dead_letter("m"))] == ["unreadable"]
    assert redis_client.get(keys.done(ok.job_id)) == "succeeded"


# -- G: a result the database refuses in every form does not block the worker ----------------

def test_result_refused_in_every_form_is_stored_bare(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
) -> None:
    w = _bare_worker(tiny_model, keys, pg_url, pg_engine, redis_client)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    bad, good = JobSpec(model=MODEL, prompt="a"), JobSpec(model=MODEL, prompt="b")
    client.submit([bad, good])
    deliveries = {d.job_id: d for d in w.queue.read(w.worker_id, 10)}
    w.deliveries.begin_deliveries([bad.id, good.id], w.worker_id, 3, time.time())
    huge = JobStats(prompt_tokens=2**40)  # out of range for the integer column
    w.results.add(Outcome(bad.id, JobStatus.SUCCEEDED, time.time(),
                          result=JobResult(text="x"), stats=huge), deliveries[bad.id])
    w.results.add(Outcome(good.id, JobStatus.SUCCEEDED, time.time(),
                          result=JobResult(text="y"), stats=JobStats()), deliveries[good.id])
    w.results.flush()  # stores, then acknowledges
    assert len(w.results) == 0 and not w.results
    infos = {i.id: i for i in client.get_many([bad.id, good.id])}
    assert infos[good.id].status is JobStatus.SUCCEEDED and infos[good.id].result.text == "y"
    assert infos[bad.id].status is JobStatus.FAILED and infos[bad.id].stats is not None
    assert "could not store the result" in infos[bad.id].error
    assert "2199023255552" not in infos[bad.id].error  # no bound parameters in error text
    assert w.queue.depth() == (0, 0)


def test_worker_id_longer_than_the_column_is_refused(tiny_model: str, keys: Keys) -> None:
    from worker_harness import worker_settings

    with pytest.raises(ValidationError, match="128"):
        worker_settings(tiny_model, keys, "sqlite://", worker_id="w" * 129)


# -- H: a graceful stop stores finished results before handing the rest back ------------------

def test_hand_back_stores_finished_results_first(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
) -> None:
    w = _bare_worker(tiny_model, keys, pg_url, pg_engine, redis_client)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    (job_id,) = client.submit([JobSpec(model=MODEL, prompt="a")])
    (d,) = w.queue.read(w.worker_id, 10)
    w.deliveries.begin_deliveries([job_id], w.worker_id, 3, time.time())
    w.results.add(Outcome(job_id, JobStatus.SUCCEEDED, time.time(),
                          result=JobResult(text="done"), stats=JobStats()), d)
    w.results.backoff.failed(time.time())  # e.g. a failed store attempt just before the stop
    w._hand_back()
    info = client.get(job_id)
    assert (info.status, info.result.text, info.attempts) == (JobStatus.SUCCEEDED, "done", 1)
    assert w.queue.depth() == (0, 0)


# -- I: terminal decisions count the delivery ------------------------------------------------

def test_dead_lettered_job_attempts_match_its_error(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    spec = JobSpec(model="m", prompt="p")
    store.insert_jobs([spec])
    for worker in ("w1", "w2"):
        store.begin_deliveries([spec.id], worker, 2, time.time())
    assert store.begin_deliveries([spec.id], "w3", 2, time.time()) == {spec.id: Decision.DEAD}
    info = store.get(spec.id)
    assert info.attempts == 3 and "delivered 3 times" in info.error


# -- J: cancelling a queued job notifies waiters like any other terminal transition ----------

def test_cancel_of_queued_job_publishes_and_expires_marker(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.done_channel())
    (job_id,) = client.submit([JobSpec(model=MODEL, prompt="a")])
    assert client.cancel(job_id) is JobStatus.CANCELLED
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
    pubsub.close()
    assert message is not None and json.loads(message["data"]) == {"id": job_id,
                                                                  "status": "cancelled"}
    assert 0 < redis_client.ttl(keys.done(job_id)) <= 24 * 3600


# -- section 3 --------------------------------------------------------------------------------

def test_payload_limit_counts_utf8_bytes() -> None:
    spec_json = json.dumps({"model": "m", "prompt": "é" * (MAX_PAYLOAD_BYTES // 2 + 10)},
                           ensure_ascii=False)  # fewer characters than the limit, more bytes
    assert len(spec_json) < MAX_PAYLOAD_BYTES < len(spec_json.encode())
    with pytest.raises(ValueError, match="byte limit"):
        decode_job(spec_json)


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


# -- section 2: drain and never-stolen, end to end -------------------------------------------

def test_drain_finishes_in_flight_jobs_on_the_same_worker(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_long(i, max_tokens=1500) for i in range(4)])  # ~1-2 s each
    running = start_worker(drain_timeout_s=20.0)
    wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING})
    stopper = threading.Thread(target=running.stop, kwargs={"timeout_s": 30})
    stopper.start()
    stopper.join(40)
    assert running.rc == 0
    for info in client.get_many(ids):
        assert (info.status, info.attempts, info.worker_id) == (
            JobStatus.SUCCEEDED, 1, running.worker.worker_id)
        assert len(info.result.token_ids) == 1500


def test_live_workers_jobs_are_never_stolen(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    first = start_worker(lease_ttl_s=1.0, max_num_seqs=4, waiting_buffer=0)
    ids = client.submit([_long(i, max_tokens=1900) for i in range(8)])  # each > the lease
    second = start_worker(lease_ttl_s=1.0, max_num_seqs=4, waiting_buffer=0)
    infos = client.wait(ids, timeout_s=120)
    assert all(i.status is JobStatus.SUCCEEDED and i.attempts == 1 for i in infos), [
        (i.status, i.attempts) for i in infos]
    assert {i.worker_id for i in infos} <= {first.worker.worker_id, second.worker.worker_id}
