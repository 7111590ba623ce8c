"""``jobs.reconcile`` value by value, on several pages (``PAGE_SIZE`` made small): which jobs
expire (this model's queued jobs past their deadline, every page of them, announced as
``expired``), which are enqueued again (queued or running jobs neither in the stream nor held by
a live worker), and stored jobs that no longer validate failing with their reason (announced
as ``failed``). Model-free: jobs stored by hand, statuses set in SQL."""

from __future__ import annotations

import json

import pytest
import redis
import sqlalchemy as sa
from services import all_roles_store

import jobs.reconcile
from jobs.constants import Keys
from jobs.queue import JobQueue
from jobs.reconcile import reconcile
from jobs.schemas import JobSpec, JobStatus

SQL = all_roles_store()


def _stored(pg_engine: sa.Engine, n: int, model: str = "m", fed: bool = True) -> list[str]:
    specs = [JobSpec(model=model, prompt=f"p{i}") for i in range(n)]
    SQL(pg_engine).insert_jobs(specs, fed=[model] if fed else [])
    return [s.id for s in specs]


def _set(pg_engine: sa.Engine, ids: list[str], sql: str, **params: object) -> None:
    with pg_engine.begin() as conn:
        for job_id in ids:
            conn.execute(sa.text(f"UPDATE jobs SET {sql} WHERE id = :id"), {"id": job_id, **params})


def _status(pg_engine: sa.Engine, job_id: str) -> str:
    with pg_engine.connect() as conn:
        return conn.execute(sa.text("SELECT status FROM jobs WHERE id = :id"),
                            {"id": job_id}).scalar_one()


def test_expiry_covers_every_page_of_this_model_only(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs.reconcile, "PAGE_SIZE", 2)
    q = JobQueue(redis_client, "m", keys)
    past = _stored(pg_engine, 5)
    future = _stored(pg_engine, 1)
    other = _stored(pg_engine, 1, model="other")
    q.enqueue(SQL(pg_engine).specs(past + future)[0])  # in the stream: only expiry applies
    _set(pg_engine, past + other, "deadline_at = now() - interval '1 minute'")
    _set(pg_engine, future, "deadline_at = now() + interval '1 hour'")
    report = reconcile(SQL(pg_engine), q, grace_s=0.0)
    assert sorted(report.expired) == sorted(past) and report.requeued == []
    assert [_status(pg_engine, j) for j in past] == ["expired"] * 5
    assert _status(pg_engine, future[0]) == "queued" and _status(pg_engine, other[0]) == "queued"
    for job_id in past:  # announced to waiters, as expired
        assert redis_client.get(keys.done(job_id)) == "expired"
    assert redis_client.get(keys.done(future[0])) is None
    assert redis_client.get(keys.done(other[0])) is None
    # A second pass has nothing left to expire.
    assert reconcile(SQL(pg_engine), q, grace_s=0.0) == jobs.reconcile.ReconcileReport([], [])


def test_requeues_exactly_the_jobs_nobody_holds(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs.reconcile, "PAGE_SIZE", 2)
    q = JobQueue(redis_client, "m", keys)
    q.heartbeat("alive", 60_000)
    lost = _stored(pg_engine, 3)  # fed, their stream entries lost
    in_stream = _stored(pg_engine, 2)
    q.enqueue(SQL(pg_engine).specs(in_stream)[0])
    held = _stored(pg_engine, 1)  # running on a live worker, its entry acked away
    orphaned = _stored(pg_engine, 1)  # running on a dead worker
    retried = _stored(pg_engine, 1)  # queued again after the live worker gave it up
    unfed = _stored(pg_engine, 2, fed=False)  # the backlog: the feeder's, not ours
    other = _stored(pg_engine, 1, model="other")
    _set(pg_engine, held, "status = 'running', worker_id = 'alive'")
    _set(pg_engine, orphaned, "status = 'running', worker_id = 'dead'")
    _set(pg_engine, retried, "worker_id = 'alive'")
    report = reconcile(SQL(pg_engine), q, grace_s=0.0)
    expected = sorted(lost + orphaned + retried)
    assert sorted(report.requeued) == expected and report.expired == []
    assert sorted(q.job_ids_in_stream()) == sorted(expected + in_stream)
    assert sorted(JobQueue(redis_client, "other", keys).job_ids_in_stream()) == []
    assert {_status(pg_engine, j) for j in lost + in_stream + retried + unfed + other} == {
        "queued"}
    assert _status(pg_engine, orphaned[0]) == "running"
    # Nothing is missing now: a second pass enqueues nothing more.
    assert reconcile(SQL(pg_engine), q, grace_s=0.0).requeued == []
    # Jobs fed within the grace may not have reached the stream yet: left alone.
    redis_client.delete(*q.streams)
    assert reconcile(SQL(pg_engine), q, grace_s=3600).requeued == []
    assert q.job_ids_in_stream() == set()


def test_stored_jobs_that_no_longer_validate_fail_on_every_page(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs.reconcile, "PAGE_SIZE", 2)
    q = JobQueue(redis_client, "m", keys)
    ids = _stored(pg_engine, 6)
    old = [ids[0], ids[3], ids[5]]  # pages: (0 1) (2 3) (4 5) in id order
    specs = {s.id: s for s in SQL(pg_engine).specs(ids)[0]}
    with pg_engine.begin() as conn:  # as an older kvbatch stored them: a top_k now refused
        for job_id in old:
            spec = {**specs[job_id].model_dump(mode="json"), "sampling": {"top_k": 2**40}}
            conn.execute(sa.text("UPDATE jobs SET spec = :spec WHERE id = :id"),
                         {"spec": json.dumps(spec), "id": job_id})
    report = reconcile(SQL(pg_engine), q, grace_s=0.0)
    good = sorted(set(ids) - set(old))
    assert sorted(report.requeued) == good and sorted(q.job_ids_in_stream()) == good
    for job_id in old:
        assert _status(pg_engine, job_id) == "failed"
        assert redis_client.get(keys.done(job_id)) == JobStatus.FAILED.value
        with pg_engine.connect() as conn:
            error = conn.execute(sa.text("SELECT error FROM jobs WHERE id = :id"),
                                 {"id": job_id}).scalar_one()
        assert error.startswith("stored job no longer valid: ") and "top_k" in error
    for job_id in good:
        assert redis_client.get(keys.done(job_id)) is None
