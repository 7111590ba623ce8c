"""The producers' writes (``jobs.store.producer``) on PostgreSQL (``COPY``) and SQLite (a Core
insert), value by value: every column of a new job, the batch rows a submission creates and
their counts, the fed mark of adapter jobs, the fence on several batches, a batch's settings
changed for that batch only, and cancels that touch the job or batch named and no other, page
by page."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from jobs.lease import LeaseLost
from jobs.models import Batch, Job
from jobs.schemas import JobSpec, JobStatus
from jobs.store import BatchStore, ProducerStore
from jobs.store.producer import CANCELLED_UNRUN
from jobs.store.transitions import aware


def _jobs(engine: Engine) -> dict[str, Job]:
    with Session(engine) as session:
        return {j.id: j for j in session.scalars(select(Job))}


def _batches(engine: Engine) -> dict[str, Batch]:
    with Session(engine) as session:
        return {b.id: b for b in session.scalars(select(Batch))}


def _spec(n: int, **kw: object) -> JobSpec:
    return JobSpec(id=f"job-{n}", model=kw.pop("model", "m"), prompt=f"p{n}", **kw)  # type: ignore[arg-type]


def _set_status(engine: Engine, status: JobStatus, *ids: str) -> None:
    with Session(engine) as session, session.begin():
        for job_id in ids:
            session.get(Job, job_id).status = status.value  # type: ignore[union-attr]


def test_every_column_of_a_new_job(sql_engine: Engine) -> None:
    deadline = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    plain = _spec(1, priority=-7, metadata={"k": [1, "two"]}, deadline=deadline,
                  batch_id="b1", custom_id="row-1")
    adapter = _spec(2, model="m:ad")
    other = _spec(3, model="n")
    ProducerStore(sql_engine).insert_jobs([plain, adapter, other], fed={"m"})
    rows = _jobs(sql_engine)
    row = rows["job-1"]
    assert (row.batch_id, row.custom_id, row.model, row.status, row.priority, row.meta,
            row.attempts, row.cancel_requested, row.worker_id) == (
        "b1", "row-1", "m", "queued", -7, {"k": [1, "two"]}, 0, False, None)
    assert aware(row.deadline_at) == deadline
    assert JobSpec.model_validate(row.spec) == plain
    assert row.fed_at is not None and aware(row.fed_at) == aware(row.created_at)
    # an adapter's job waits in its base model's queue, fed with it; its spec keeps the adapter
    assert rows["job-2"].model == "m" and rows["job-2"].spec["model"] == "m:ad"
    assert rows["job-2"].fed_at is not None
    assert rows["job-3"].model == "n" and rows["job-3"].fed_at is None  # not fed: the backlog
    assert rows["job-2"].deadline_at is None and rows["job-2"].meta == {}


def test_deadlines_at_any_offset_are_stored_as_their_instant(sql_engine: Engine) -> None:
    # SQLite keeps a time's digits and drops its offset: stored as given, a deadline at
    # +02:00 read back two hours late (the batch's, and each job's)
    east = datetime(2030, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    store = ProducerStore(sql_engine)
    store.insert_jobs([_spec(1, batch_id="a", custom_id="1", deadline=east)], deadline=east)
    assert aware(_jobs(sql_engine)["job-1"].deadline_at) == east
    assert aware(_batches(sql_engine)["a"].deadline_at) == east
    west = datetime(2031, 1, 1, tzinfo=timezone(timedelta(hours=-5)))
    store.configure_batch("a", deadline=west)
    assert aware(_batches(sql_engine)["a"].deadline_at) == west


def test_batches_are_created_once_with_the_first_submissions_settings(
        sql_engine: Engine) -> None:
    store = ProducerStore(sql_engine)
    deadline = datetime(2030, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    store.insert_jobs([_spec(1, batch_id="a", custom_id="1", model="ma"),
                       _spec(2, batch_id="b", custom_id="1", model="mb"),
                       _spec(3, batch_id="a", custom_id="2", model="ma"),
                       _spec(4)],
                      webhook_url="https://example.com/hook", deadline=deadline)
    batches = _batches(sql_engine)
    assert set(batches) == {"a", "b"}
    a, b = batches["a"], batches["b"]
    assert (a.model, a.num_jobs, a.status, a.webhook_url) == (
        "ma", 2, "in_progress", "https://example.com/hook")
    assert (b.model, b.num_jobs) == ("mb", 1)
    assert aware(a.deadline_at) == deadline and aware(b.deadline_at) == deadline
    assert a.started_at is not None and aware(a.started_at) == aware(a.created_at)
    # a later submission adds to the count and keeps the batch's own settings
    store.insert_jobs([_spec(5, batch_id="a", custom_id="3", model="ma")],
                      webhook_url="https://example.com/other", deadline=None)
    a = _batches(sql_engine)["a"]
    assert (a.num_jobs, a.webhook_url) == (3, "https://example.com/hook")
    assert aware(a.deadline_at) == deadline
    store.insert_jobs([])  # nothing: no error, no change
    assert _batches(sql_engine)["a"].num_jobs == 3


def test_a_naive_deadline_is_utc(sql_engine: Engine) -> None:
    store = ProducerStore(sql_engine)
    store.insert_jobs([_spec(1, batch_id="a", custom_id="1")],
                      deadline=datetime(2030, 5, 6, 7, 8, 9))
    assert aware(_batches(sql_engine)["a"].deadline_at) == datetime(2030, 5, 6, 7, 8, 9,
                                                                    tzinfo=UTC)


def test_the_fence_must_be_the_newest_of_every_batch(sql_engine: Engine) -> None:
    batches, store = BatchStore(sql_engine), ProducerStore(sql_engine)
    for b in ("a", "b"):
        batches.create(b, 3600)
    assert batches.fence("a", 20) and batches.fence("b", 30)
    with pytest.raises(LeaseLost):  # a's newest token, not b's (a newer holder took b)
        store.insert_jobs([_spec(1, batch_id="a", custom_id="1"),
                           _spec(2, batch_id="b", custom_id="1")], fence=20)
    assert _jobs(sql_engine) == {}
    store.insert_jobs([_spec(1, batch_id="a", custom_id="1")], fence=20)
    store.insert_jobs([_spec(2, batch_id="b", custom_id="1")], fence=30)
    assert set(_jobs(sql_engine)) == {"job-1", "job-2"}


def test_configure_batch_sets_that_batch_only(sql_engine: Engine) -> None:
    store = ProducerStore(sql_engine)
    store.insert_jobs([_spec(1, batch_id="a", custom_id="1"),
                       _spec(2, batch_id="b", custom_id="1")])
    deadline = datetime(2031, 1, 1, tzinfo=timezone(timedelta(hours=-5)))
    store.configure_batch("a", webhook_url="https://example.com/a", deadline=deadline)
    batches = _batches(sql_engine)
    assert batches["a"].webhook_url == "https://example.com/a"
    assert aware(batches["a"].deadline_at) == deadline
    assert batches["b"].webhook_url is None and batches["b"].deadline_at is None
    store.configure_batch("a", deadline=datetime(2032, 1, 1))  # the webhook stays
    a = _batches(sql_engine)["a"]
    assert a.webhook_url == "https://example.com/a"
    assert aware(a.deadline_at) == datetime(2032, 1, 1, tzinfo=UTC)
    store.configure_batch("a", webhook_url="https://example.com/a2")  # the deadline stays
    a = _batches(sql_engine)["a"]
    assert (a.webhook_url, aware(a.deadline_at)) == (
        "https://example.com/a2", datetime(2032, 1, 1, tzinfo=UTC))


def test_request_cancel_touches_the_named_job_only(sql_engine: Engine) -> None:
    store = ProducerStore(sql_engine)
    store.insert_jobs([_spec(i) for i in range(4)])
    _set_status(sql_engine, JobStatus.RUNNING, "job-1", "job-2")
    _set_status(sql_engine, JobStatus.SUCCEEDED, "job-3")
    assert store.request_cancel("job-0", time.time()) is JobStatus.CANCELLED
    assert store.request_cancel("job-1", time.time()) is JobStatus.RUNNING
    assert store.request_cancel("job-3", time.time()) is JobStatus.SUCCEEDED
    assert store.request_cancel("nope", time.time()) is None
    rows = _jobs(sql_engine)
    assert (rows["job-0"].status, rows["job-0"].error) == ("cancelled", CANCELLED_UNRUN)
    assert {j: (r.status, r.cancel_requested) for j, r in rows.items()} == {
        "job-0": ("cancelled", False), "job-1": ("running", True),
        "job-2": ("running", False), "job-3": ("succeeded", False)}


@pytest.mark.timeout(120)  # a page that does not move on loops forever: fail, do not hang
@pytest.mark.parametrize("limit", [1, 2, 3, 1000])
def test_cancel_batch_pages_through_the_batch_and_no_other(sql_engine: Engine,
                                                           limit: int) -> None:
    store = ProducerStore(sql_engine)
    mine = [_spec(i, batch_id="mine", custom_id=f"r{i:02d}") for i in range(9)]
    theirs = [_spec(100 + i, batch_id="theirs", custom_id=f"r{i:02d}") for i in range(3)]
    store.insert_jobs([*mine, *theirs, _spec(200)])
    running = ["job-1", "job-2", "job-5", "job-8", "job-101"]
    _set_status(sql_engine, JobStatus.RUNNING, *running)
    _set_status(sql_engine, JobStatus.SUCCEEDED, "job-3")
    cancelled, flagged = store.cancel_batch("mine", time.time(), limit=limit)
    assert sorted(cancelled) == ["job-0", "job-4", "job-6", "job-7"]
    assert sorted(flagged) == ["job-1", "job-2", "job-5", "job-8"]  # each once
    rows = _jobs(sql_engine)
    assert {j for j, r in rows.items() if r.status == "cancelled"} == set(cancelled)
    assert all(rows[j].error == CANCELLED_UNRUN for j in cancelled)
    assert {j for j, r in rows.items() if r.cancel_requested} == set(flagged)
    assert rows["job-3"].status == "succeeded"
    for j in ("job-100", "job-102", "job-200"):  # another batch's, and a job of none
        assert rows[j].status == "queued"
    assert rows["job-101"].status == "running" and not rows["job-101"].cancel_requested
    again, still_running = store.cancel_batch("mine", time.time(), limit=limit)
    assert again == [] and sorted(still_running) == sorted(flagged)  # flagged again, once
