"""A worker holds its jobs by its lease, the heartbeat key it renews from its own thread: a
worker restarted under the same id takes back what its last process held; the lease survives
a loop stalled in a slow database call and lapses when the loop is stuck; the jobs of a live
worker are never stolen, however long they run."""

from __future__ import annotations

import time

import redis
import sqlalchemy as sa
from services import all_roles_store
from worker_harness import long_job, paced

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.queue import JobQueue
from jobs.schemas import JobSpec, JobStatus
from worker.heartbeat import Heartbeat

SQL = all_roles_store()

MODEL = "tiny"


def test_restart_with_same_worker_id_takes_back_its_pending_jobs(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([long_job(i, max_tokens=8) for i in range(3)])
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


def test_lease_survives_a_stalled_loop(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([long_job(i, max_tokens=1900) for i in range(2)])
    running = start_worker(lease_ttl_s=2.0)  # renewed every 0.67 s, from its own thread
    wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING})
    blocker = JobSpec(model=MODEL, prompt="locked")
    SQL(client.engine).insert_jobs([blocker])
    with pg_engine.connect() as conn, conn.begin():
        # The worker's decision on this job waits for our row lock: its loop stalls 4 s, two
        # TTLs.
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
    beat.start()  # its first beat, before it returns
    try:
        assert q.live_workers() == {"stuck"}
        wait_for(lambda: not q.live_workers(), timeout_s=15)  # no progress: no renewal
    finally:
        beat.stop()


def test_live_workers_jobs_are_never_stolen(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    # Leases of 2 s (a renewal may come a second late on a loaded 2-core machine); each job
    # 9.5 s or more (paced), however fast the machine
    first = start_worker(lease_ttl_s=2.0, max_num_seqs=4, waiting_buffer=0, engine_wrapper=paced)
    ids = client.submit([long_job(i, max_tokens=1900) for i in range(8)])
    second = start_worker(lease_ttl_s=2.0, max_num_seqs=4, waiting_buffer=0, engine_wrapper=paced)
    infos = client.wait(ids, timeout_s=240)
    assert all(i.status is JobStatus.SUCCEEDED and i.attempts == 1 for i in infos), [
        (i.status, i.attempts) for i in infos]
    assert {i.worker_id for i in infos} <= {first.worker.worker_id, second.worker.worker_id}
    # each job ran past its worker's lease: only the renewals kept it
    assert all((i.finished_at - i.started_at).total_seconds() > 2.0 for i in infos)  # type: ignore[operator]
