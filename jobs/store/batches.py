"""The one lifecycle of a batch (``BatchStatus``), in SQL: every move of a batch's status is
here, guarded by the status it leaves, so running a step twice changes nothing the second time.

``create`` (an HTTP batch, ``validating``) → ``start`` (``in_progress``) or ``fail``; a queue
batch is created ``in_progress`` with its first jobs (``ProducerStore.insert_jobs``).
``complete_batches`` is the one place that sees a batch end: every job terminal and no new job
for the settle time, ``completed`` (``cancelled`` after :meth:`request_cancel`);
``expire_batches`` the one expiry (deadline passed: its active jobs and the batch ``expired``).
Then the batch is finalized: its exports (``jobs.export``), the completion event and the webhook
(``notified_at``) by the control plane, its files by the HTTP API."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, case, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, Job
from jobs.schemas import ENDED_BATCH, BatchStatus, JobStatus
from jobs.settings import redact_urls
from jobs.store.transitions import ACTIVE, aware, db_now, end_many, to_dt

ACTIVE_BATCH = [s.value for s in BatchStatus if not s.ended]  # validating, in_progress


@dataclass(frozen=True)
class BatchState:
    """A batch row as the control plane reads it."""

    id: str
    model: str
    status: BatchStatus
    num_jobs: int
    completed_at: datetime | None
    webhook_url: str | None
    webhook_attempts: int
    webhook_next_at: datetime | None
    results_path: str | None
    notified_at: datetime | None


class BatchStore:
    """A batch's status moves, and the bookkeeping of its finalization."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, batch_id: str, window_s: float, with_rows: Sequence[object] = (), *,
               owner: str | None = None,
               before: Callable[[Session], None] = lambda _: None) -> Batch:
        """A new ``validating`` batch of tenant ``owner``, due ``window_s`` from now (the
        database's clock), inserted with ``with_rows`` (what the caller adds to it) in one
        transaction, which ``before`` starts (a quota check that raises)."""
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            before(session)
            now = db_now(session)
            row = Batch(id=batch_id, model="", meta={}, created_at=now, num_jobs=0,
                        deadline_at=now + timedelta(seconds=window_s), owner=owner,
                        status=BatchStatus.VALIDATING.value)
            session.add(row)
            session.flush()
            session.add_all(with_rows)
        return row

    def open(self, batch_id: str, model: str, owner: str,
             meta: dict[str, Any] | None = None) -> str | None:
        """Make queue batch ``batch_id`` of tenant ``owner`` (``in_progress``, as
        ``ProducerStore.insert_jobs`` makes one) unless it exists; the batch's tenant (another
        one's if the id was taken: the caller refuses it)."""
        with Session(self.engine) as session, session.begin():
            found = session.execute(select(Batch.owner).where(Batch.id == batch_id)).first()
            if found is not None:
                return found.owner
            now = db_now(session)
            session.add(Batch(id=batch_id, model=model, meta=meta or {}, created_at=now,
                              started_at=now, num_jobs=0, owner=owner,
                              status=BatchStatus.IN_PROGRESS.value))
        return owner

    def fence(self, batch_id: str, token: int) -> bool:
        """Record ``token``, a fencing token of the batch's lease, as the newest: writes that
        carry an older one are refused from now on. False if a newer one is there."""
        with Session(self.engine) as session, session.begin():
            return fence_batch(session, batch_id, token, claim=True)

    def start(self, batch_id: str, model: str, fence: int) -> bool:
        """``validating`` → ``in_progress`` once its jobs are stored, all of ``model``."""
        return self._move(batch_id, BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS,
                          "started_at", fence, model=model)

    def fail(self, batch_id: str, fence: int) -> bool:
        """``validating`` → ``failed``: its input cannot run."""
        return self._move(batch_id, BatchStatus.VALIDATING, BatchStatus.FAILED, "completed_at",
                          fence)

    def _move(self, batch_id: str, before: BatchStatus, after: BatchStatus, stamp: str,
              fence: int, **values: Any) -> bool:
        with Session(self.engine) as session, session.begin():
            moved = session.execute(
                update(Batch).where(Batch.id == batch_id, Batch.status == before.value,
                                    Batch.fence == fence)
                .values(status=after.value, **{stamp: db_now(session)}, **values))
        return moved.rowcount == 1

    def request_cancel(self, batch_id: str) -> BatchStatus | None:
        """Ask batch ``batch_id`` to end ``cancelled`` (the caller cancels its jobs): it ends
        so once they are all terminal. Returns its status (None: unknown)."""
        with Session(self.engine) as session, session.begin():
            session.execute(update(Batch).where(
                Batch.id == batch_id, Batch.cancel_requested_at.is_(None),
                Batch.status.in_(ACTIVE_BATCH))
                .values(cancel_requested_at=db_now(session)))
            status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
        return None if status is None else BatchStatus(status)

    def status(self, batch_id: str) -> BatchStatus | None:
        with Session(self.engine) as session:
            status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
        return None if status is None else BatchStatus(status)

    def complete_batches(self, now_s: float, settle_s: float,
                         batch_ids: Collection[str] | None = None) -> list[str]:
        """End every in-progress batch (of ``batch_ids``, else of all) whose jobs are all
        terminal and that got no new job for ``settle_s`` (a producer may still be adding
        chunks of a large dataset): ``cancelled`` if a cancel was asked for, ``expired`` if its
        deadline passed with jobs expired, else ``completed``. A batch with no job ends only
        when cancelled. ``created_at`` is stamped by the database's clock, so the settle time
        is measured on it."""
        of_batch = Job.batch_id == Batch.id
        has_active = select(Job.id).where(of_batch, Job.status.in_(ACTIVE))
        has_jobs = select(Job.id).where(of_batch)
        has_expired = select(Job.id).where(of_batch, Job.status == JobStatus.EXPIRED.value)
        ended = case(
            (Batch.cancel_requested_at.is_not(None), BatchStatus.CANCELLED.value),
            (Batch.deadline_at.is_not(None) & (Batch.deadline_at <= to_dt(now_s))
             & has_expired.exists(), BatchStatus.EXPIRED.value),
            else_=BatchStatus.COMPLETED.value)
        with Session(self.engine) as session, session.begin():
            settled_before = db_now(session) - timedelta(seconds=settle_s)
            has_recent = select(Job.id).where(of_batch, Job.created_at > settled_before)
            query = (update(Batch)
                     .where(Batch.status == BatchStatus.IN_PROGRESS.value,
                            has_jobs.exists() | Batch.cancel_requested_at.is_not(None),
                            ~has_active.exists(), ~has_recent.exists()))
            if batch_ids is not None:
                query = query.where(Batch.id.in_(list(batch_ids)))
            done = session.scalars(query.values(status=ended, completed_at=to_dt(now_s))
                                   .returning(Batch.id)).all()
        return list(done)

    def expire_batches(self, now_s: float, limit: int = 1000,
                       batch_ids: Collection[str] | None = None,
                       ) -> dict[str, list[tuple[str, str]]]:
        """Batches not ended (of ``batch_ids``, else all: in progress, or HTTP batches still
        validating) whose deadline passed become ``expired`` with every active job in them.
        ``limit`` jobs per transaction; the batch's status changes in the transaction that
        expires its last active jobs, so a crash midway leaves it as it was (and past its
        deadline: the next run carries on). Returns batch id -> (job id, status before)."""
        query = select(Batch.id).where(Batch.status.in_(ACTIVE_BATCH),
                                       Batch.deadline_at.is_not(None),
                                       Batch.deadline_at <= to_dt(now_s))
        if batch_ids is not None:
            query = query.where(Batch.id.in_(list(batch_ids)))
        with Session(self.engine) as session:
            due_ids = session.scalars(query).all()
        expired: dict[str, list[tuple[str, str]]] = {}
        for due_id in due_ids:
            done: list[tuple[str, str]] = []
            while True:
                with Session(self.engine) as session, session.begin():
                    rows = session.execute(
                        select(Job.id, Job.status)
                        .where(Job.batch_id == due_id, Job.status.in_(ACTIVE))
                        .order_by(Job.id).limit(limit).with_for_update()
                    ).all()
                    done += end_many(session, [(r.id, r.status, "batch deadline passed")
                                               for r in rows], JobStatus.EXPIRED, now_s)
                    if len(rows) < limit:
                        res = session.execute(
                            update(Batch)
                            .where(Batch.id == due_id, Batch.status.in_(ACTIVE_BATCH))
                            .values(status=BatchStatus.EXPIRED.value,
                                    completed_at=to_dt(now_s)))
                        if res.rowcount == 1:
                            expired[due_id] = done
                        break
        return expired

    def due_batches(self, now_s: float, limit: int = 100) -> list[str]:
        """Ended batches not yet finalized whose next webhook attempt (if any) is due."""
        with Session(self.engine) as session:
            return list(session.scalars(
                select(Batch.id).where(
                    Batch.status.in_(ENDED_BATCH), Batch.notified_at.is_(None),
                    Batch.webhook_next_at.is_(None) | (Batch.webhook_next_at <= to_dt(now_s)),
                ).order_by(Batch.completed_at).limit(limit)
            ))

    def load(self, batch_id: str) -> BatchState | None:
        """The batch row ``batch_id`` (None if unknown)."""
        with Session(self.engine) as session:
            b = session.get(Batch, batch_id)
            if b is None:
                return None
            return BatchState(
                id=b.id, model=b.model, status=BatchStatus(b.status), num_jobs=b.num_jobs,
                completed_at=aware(b.completed_at), webhook_url=b.webhook_url,
                webhook_attempts=b.webhook_attempts, webhook_next_at=aware(b.webhook_next_at),
                results_path=b.results_path, notified_at=aware(b.notified_at),
            )

    def record_export(self, batch_id: str, path: str) -> None:
        self._set(batch_id, results_path=path)

    def record_webhook_attempt(self, batch_id: str, now_s: float, error: str | None,
                               max_attempts: int, retry_in_s: float,
                               delivered: bool | None = None) -> bool:
        """Count one finalization attempt (export or webhook) with its error, if any (URLs in
        it redacted: the column is readable by dashboards); True when the batch is now
        finalized: delivered (default: no error), or the last attempt failed."""
        delivered = error is None if delivered is None else delivered
        error = None if error is None else redact_urls(error)
        with Session(self.engine) as session, session.begin():
            attempts = session.scalar(
                update(Batch).where(Batch.id == batch_id)
                .values(webhook_attempts=Batch.webhook_attempts + 1, webhook_error=error)
                .returning(Batch.webhook_attempts)
            ) or 0
            settled = delivered or attempts >= max_attempts
            session.execute(update(Batch).where(Batch.id == batch_id).values(
                notified_at=to_dt(now_s) if settled else None,
                webhook_next_at=None if settled else to_dt(now_s + retry_in_s),
            ))
        return settled

    def mark_notified(self, batch_id: str, now_s: float) -> None:
        self._set(batch_id, notified_at=to_dt(now_s))

    def _set(self, batch_id: str, **values: Any) -> None:
        with Session(self.engine) as session, session.begin():
            session.execute(update(Batch).where(Batch.id == batch_id).values(**values))


def fence_batch(session: Session, batch_id: str, token: int, *, claim: bool = False) -> bool:
    """In ``session``'s transaction, check that ``token`` is the batch's newest fencing token
    (with ``claim``: make it so, unless a newer one is there), locking the batch row until the
    transaction ends, so that a newer holder's claim waits for it."""
    newest = Batch.fence.is_(None) | (Batch.fence <= token) if claim else Batch.fence == token
    return session.execute(update(Batch).where(Batch.id == batch_id, newest)
                           .values(fence=token)).rowcount == 1
