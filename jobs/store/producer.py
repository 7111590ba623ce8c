"""The producers' writes: jobs and their batches in, batch settings, cancellation."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, insert, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from jobs.lease import LeaseLost
from jobs.models import Batch, Job
from jobs.schemas import JobSpec, JobStatus, Outcome, queue_model
from jobs.store.batches import fence_batch
from jobs.store.transitions import ACTIVE, db_now, end_many, terminalize

CANCELLED_UNRUN = "cancelled before it started"


class ProducerStore:
    """Inserts jobs, configures batches and cancels jobs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def insert_jobs(self, specs: Sequence[JobSpec], *, webhook_url: str | None = None,
                    deadline: datetime | None = None, fed: Collection[str] = (),
                    fence: int | None = None) -> None:
        """Insert ``specs`` as queued jobs in one transaction, creating missing batch rows
        (``in_progress``) with ``webhook_url`` and ``deadline``: a batch's settings are those of
        the submission that created it (an existing batch keeps its own). Jobs of the models in
        ``fed`` are marked fed (the caller adds them to their streams); the others join the
        backlog (``jobs.feed``). With ``fence`` (a token of the batches' lease) nothing is
        stored unless it is their newest: ``LeaseLost`` otherwise."""
        if not specs:
            return
        with Session(self.engine) as session, session.begin():
            now = db_now(session)
            batch_ids = {s.batch_id for s in specs if s.batch_id is not None}
            if fence is not None and not all(fence_batch(session, b, fence) for b in batch_ids):
                raise LeaseLost(f"batch lease token {fence} is not the newest")
            if batch_ids:
                known = set(session.scalars(select(Batch.id).where(Batch.id.in_(batch_ids))))
                for batch_id in sorted(batch_ids - known):
                    first = next(s for s in specs if s.batch_id == batch_id)
                    session.add(Batch(id=batch_id, model=first.model, meta={},
                                      created_at=now, started_at=now, num_jobs=0,
                                      webhook_url=webhook_url,
                                      deadline_at=_aware_utc(deadline)))
                session.flush()
                for batch_id in batch_ids:
                    n = sum(1 for s in specs if s.batch_id == batch_id)
                    session.execute(update(Batch).where(Batch.id == batch_id)
                                    .values(num_jobs=Batch.num_jobs + n))
            copy = session.get_bind().dialect.name == "postgresql"
            rows = [_job_row(s, now, queue_model(s.model) in fed, json_text=copy)
                    for s in specs]
            if copy:
                _copy_rows(session, rows)
            else:  # a Core insert (executemany): the ORM's bulk path costs a third more a row
                session.execute(insert(Job.__table__), rows)

    def analyze(self) -> None:
        """Refresh the planner's statistics of the jobs table (PostgreSQL; SQLite needs none).
        Right after a bulk load, before autovacuum gets to it, the planner takes a batch of a
        million rows for a few hundred: a cancel then sorted the whole batch for every page of
        1,000 (1 s a page)."""
        if self.engine.dialect.name == "postgresql":
            with self.engine.begin() as conn:
                conn.execute(text("ANALYZE jobs"))

    def configure_batch(self, batch_id: str, *, webhook_url: str | None = None,
                        deadline: datetime | None = None) -> None:
        """Set a batch's completion webhook and its deadline (the batch row must exist)."""
        values: dict[str, Any] = {}
        if webhook_url is not None:
            values["webhook_url"] = webhook_url
        if deadline is not None:
            values["deadline_at"] = _aware_utc(deadline)
        if values:
            with Session(self.engine) as session, session.begin():
                session.execute(update(Batch).where(Batch.id == batch_id).values(**values))

    def request_cancel(self, job_id: str, now_s: float) -> JobStatus | None:
        """Cancel a queued job at once; flag a running one (the caller tells its worker).
        Returns the job's status afterwards, or None for an unknown job."""
        with Session(self.engine) as session, session.begin():
            row = session.execute(
                select(Job.status).where(Job.id == job_id).with_for_update()
            ).first()
            if row is None:
                return None
            status = JobStatus(row.status)
            if status is JobStatus.QUEUED:
                terminalize(session, Outcome(job_id, JobStatus.CANCELLED, now_s,
                                             error=CANCELLED_UNRUN))
                return JobStatus.CANCELLED
            if status is JobStatus.RUNNING:
                session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
            return status


    def cancel_batch(self, batch_id: str, now_s: float,
                     limit: int = 1000) -> tuple[list[str], list[str]]:
        """Cancel every queued job of ``batch_id`` at once and flag every running one (the
        caller tells their workers), ``limit`` jobs per transaction. Returns (ids cancelled
        now, ids of running jobs flagged)."""
        cancelled: list[str] = []
        running: list[str] = []
        # Pages in custom_id order along the (batch_id, custom_id) index: each page goes on
        # where the last ended, whatever the batch's size (paging by status made every page
        # walk the rows earlier pages had ended). A batch's rows always have a custom_id.
        after = ""
        while True:
            with Session(self.engine) as session, session.begin():
                rows = session.execute(
                    select(Job.id, Job.status, Job.custom_id)
                    .where(Job.batch_id == batch_id, Job.custom_id > after,
                           Job.status.in_(ACTIVE))
                    .order_by(Job.custom_id).limit(limit).with_for_update()
                ).all()
                queued = [(r.id, r.status, CANCELLED_UNRUN) for r in rows
                          if r.status == JobStatus.QUEUED.value]
                cancelled += [job_id for job_id, _ in
                              end_many(session, queued, JobStatus.CANCELLED, now_s)]
                flagged = [r.id for r in rows if r.status == JobStatus.RUNNING.value]
                if flagged:
                    session.execute(update(Job).where(Job.id.in_(flagged))
                                    .values(cancel_requested=True))
                running += flagged
            if len(rows) < limit:
                return cancelled, running
            after = rows[-1].custom_id


_QUEUED = JobStatus.QUEUED.value


def _job_row(spec: JobSpec, created_at: datetime, fed: bool,
             json_text: bool = False) -> dict[str, Any]:
    """The ``jobs`` row of a new job, by column name; with ``json_text`` its JSON columns hold
    their text (for ``COPY``; the spec's is made once, see ``JobSpec.wire_json``)."""
    return {
        "id": spec.id,
        "batch_id": spec.batch_id,
        "custom_id": spec.custom_id,
        "model": queue_model(spec.model),  # the spec keeps the adapter, if any
        "status": _QUEUED,
        "priority": spec.priority,
        "spec": spec.wire_json if json_text else spec.model_dump(mode="json"),
        # the column (the model's attribute is ``meta``)
        "metadata": json.dumps(spec.metadata) if json_text else spec.metadata,
        "created_at": created_at,  # the database's clock: the reconciler's grace uses it
        "deadline_at": _aware_utc(spec.deadline),
        "fed_at": created_at if fed else None,
        "attempts": 0,
        "cancel_requested": False,
    }


def _copy_rows(session: Session, rows: list[dict[str, Any]]) -> None:
    """Write new ``jobs`` rows (``_job_row(..., json_text=True)``) with PostgreSQL's ``COPY``,
    in the session's transaction: one stream of rows instead of a statement a row."""
    statement = f"COPY jobs ({', '.join(rows[0])}) FROM STDIN"
    raw = session.connection().connection.driver_connection
    dbapi = session.get_bind().dialect.dbapi
    assert raw is not None and dbapi is not None
    try:
        with raw.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(tuple(row.values()))
    except dbapi.Error as exc:  # as SQLAlchemy raises it (IntegrityError for a duplicate...)
        raise DBAPIError.instance(statement, None, exc, dbapi.Error,
                                  hide_parameters=True) from exc


def _aware_utc(dt: datetime | None) -> datetime | None:
    """``dt`` in UTC (a naive one is taken as UTC): SQLite keeps a time's digits and drops its
    offset, so a deadline given at +02:00 would read back two hours late."""
    if dt is None:
        return None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
