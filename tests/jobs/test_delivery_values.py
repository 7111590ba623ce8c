"""The workers' writes (``jobs.store.delivery``) on PostgreSQL and SQLite, value by value: each
decision's status, error, attempts and worker, the deadline's edge, the delivery limit's edge,
the first start and fed times kept over a redelivery, a restarted worker's own running jobs,
unknown ids, and a hand-back that touches only this worker's running jobs."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from jobs.models import Job
from jobs.schemas import JobSpec, JobStatus, Outcome
from jobs.store import ProducerStore
from jobs.store.delivery import Decision, DeliveryStore
from jobs.store.transitions import EXPIRED_UNRUN, aware

T0 = 1_900_000_000.0  # a fixed "now" for every decision


def _insert(engine: Engine, n: int, *, deadline: datetime | None = None) -> list[str]:
    specs = [JobSpec(id=f"job-{i}", model="m", prompt=f"p{i}", deadline=deadline)
             for i in range(n)]
    ProducerStore(engine).insert_jobs(specs)
    return [s.id for s in specs]


def _row(engine: Engine, job_id: str) -> Job:
    with Session(engine) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def _set(engine: Engine, job_id: str, **values: object) -> None:
    with Session(engine) as session, session.begin():
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def test_decisions_name_their_statuses() -> None:
    assert {d: d.status for d in Decision} == {
        Decision.RUN: None, Decision.SKIP: None, Decision.DEAD: JobStatus.FAILED,
        Decision.EXPIRED: JobStatus.EXPIRED, Decision.CANCELLED: JobStatus.CANCELLED}


def test_run_marks_running_counts_and_stamps_once(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    [job] = _insert(sql_engine, 1)
    assert store.begin_deliveries([job], "w1", 3, T0) == {job: Decision.RUN}
    row = _row(sql_engine, job)
    assert (row.status, row.attempts, row.worker_id) == ("running", 1, "w1")
    assert aware(row.started_at).timestamp() == pytest.approx(T0, abs=1e-3)  # type: ignore[union-attr]
    assert aware(row.fed_at).timestamp() == pytest.approx(T0, abs=1e-3)  # type: ignore[union-attr]
    assert store.release([job], "w1") == 1
    # redelivered later (its worker handed it back): the first start and feed times stay
    assert store.begin_deliveries([job], "w2", 3, T0 + 500) == {job: Decision.RUN}
    row = _row(sql_engine, job)
    assert (row.status, row.attempts, row.worker_id) == ("running", 1, "w2")
    assert aware(row.started_at).timestamp() == pytest.approx(T0, abs=1e-3)  # type: ignore[union-attr]
    assert aware(row.fed_at).timestamp() == pytest.approx(T0, abs=1e-3)  # type: ignore[union-attr]


def test_a_fed_job_keeps_its_fed_time(sql_engine: Engine) -> None:
    ProducerStore(sql_engine).insert_jobs([JobSpec(id="fed", model="m", prompt="p")],
                                          fed={"m"})
    fed_at = aware(_row(sql_engine, "fed").fed_at)
    assert fed_at is not None
    DeliveryStore(sql_engine).begin_deliveries(["fed"], "w1", 3, T0)
    assert aware(_row(sql_engine, "fed").fed_at) == fed_at


def test_a_restarted_worker_runs_its_own_running_job_again(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    [job] = _insert(sql_engine, 1)
    store.begin_deliveries([job], "w1", 3, T0)
    # w1 restarted under its id: its earlier copy is not a live duplicate
    assert store.begin_deliveries([job], "w1", 3, T0, live_workers={"w1", "w2"}) == {
        job: Decision.RUN}
    assert (_row(sql_engine, job).attempts, _row(sql_engine, job).worker_id) == (2, "w1")
    # a copy delivered to w2 while w1 lives is skipped and not counted
    assert store.begin_deliveries([job], "w2", 3, T0, live_workers={"w1", "w2"}) == {
        job: Decision.SKIP}
    assert (_row(sql_engine, job).attempts, _row(sql_engine, job).worker_id) == (2, "w1")


def test_the_delivery_limit_is_inclusive(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    [job] = _insert(sql_engine, 1)
    for n in range(1, 4):  # deliveries 1, 2 and 3 of at most 3 run
        assert store.begin_deliveries([job], f"w{n}", 3, T0) == {job: Decision.RUN}
    assert store.begin_deliveries([job], "w4", 3, T0) == {job: Decision.DEAD}
    row = _row(sql_engine, job)
    assert (row.status, row.attempts, row.worker_id, row.error) == (
        "failed", 4, "w4", "dead-lettered: delivered 4 times (limit 3) without finishing")
    assert store.begin_deliveries([job], "w5", 3, T0) == {job: Decision.SKIP}  # terminal
    assert _row(sql_engine, job).attempts == 4


def test_the_deadline_passes_at_its_instant(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    deadline = datetime.fromtimestamp(T0, UTC)
    early, due = _insert(sql_engine, 2, deadline=deadline)
    assert store.begin_deliveries([early], "w1", 3, T0 - 0.5) == {early: Decision.RUN}
    assert store.begin_deliveries([due], "w1", 3, T0) == {due: Decision.EXPIRED}
    row = _row(sql_engine, due)
    assert (row.status, row.attempts, row.worker_id, row.error) == (
        "expired", 1, "w1", EXPIRED_UNRUN)


def test_a_cancel_requested_job_is_cancelled_first(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    [job] = _insert(sql_engine, 1, deadline=datetime.fromtimestamp(T0 - 10, UTC))
    _set(sql_engine, job, cancel_requested=True, attempts=7)  # also late, also over the limit
    assert store.begin_deliveries([job], "w1", 3, T0) == {job: Decision.CANCELLED}
    row = _row(sql_engine, job)
    assert (row.status, row.attempts, row.worker_id, row.error) == (
        "cancelled", 8, "w1", "cancelled")


def test_unknown_and_terminal_ids_are_skipped_in_one_call(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    a, b, c = _insert(sql_engine, 3)
    assert store.finish([Outcome(b, JobStatus.SUCCEEDED, T0)], "w0") == {b}
    assert store.finish([Outcome(b, JobStatus.FAILED, T0, error="late")], "w0") == set()
    assert store.begin_deliveries([a, b, "nope", c], "w1", 3, T0) == {
        a: Decision.RUN, b: Decision.SKIP, "nope": Decision.SKIP, c: Decision.RUN}
    assert store.begin_deliveries([], "w1", 3, T0) == {}
    row = _row(sql_engine, b)
    assert (row.status, row.error, row.attempts, row.worker_id) == ("succeeded", None, 0, "w0")


def test_release_hands_back_only_this_workers_running_jobs(sql_engine: Engine) -> None:
    store = DeliveryStore(sql_engine)
    mine, theirs, done, zero = _insert(sql_engine, 4)
    store.begin_deliveries([mine, done, zero], "w1", 3, T0)
    store.begin_deliveries([theirs], "w2", 3, T0)
    store.finish([Outcome(done, JobStatus.SUCCEEDED, T0)], "w1")
    _set(sql_engine, zero, attempts=0)  # never below zero
    assert store.release([mine, theirs, done, zero, "nope"], "w1") == 2
    with Session(sql_engine) as session:
        rows = {r.id: (r.status, r.attempts, r.worker_id) for r in session.scalars(select(Job))}
    assert rows == {mine: ("queued", 0, None), zero: ("queued", 0, None),
                    theirs: ("running", 1, "w2"), done: ("succeeded", 1, "w1")}
    assert store.release([], "w1") == 0
