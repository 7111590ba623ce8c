"""Batch rows through their lifecycle: ``in_progress`` → ``completed`` (every job terminal) or
``expired`` (:meth:`MaintenanceStore.expire_batches`), then finalized by the control plane:
results exported, completion event published, webhook delivered or given up, ``notified_at``
set. Every step is guarded by the row's state, so running it twice changes nothing the second
time."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, Job
from jobs.schemas import BatchStatus
from jobs.settings import redact_urls
from jobs.store.transitions import ACTIVE, aware, db_now, to_dt


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
    """Completion, finalization and webhook bookkeeping of batch rows."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def complete_batches(self, now_s: float, settle_s: float) -> list[str]:
        """Mark ``completed`` every in-progress batch whose jobs are all terminal and that got
        no new job for ``settle_s`` (a producer may still be adding chunks of a large
        dataset). ``created_at`` is stamped by the database's clock, so the settle time is
        measured on it."""
        has_active = select(Job.id).where(Job.batch_id == Batch.id, Job.status.in_(ACTIVE))
        has_jobs = select(Job.id).where(Job.batch_id == Batch.id)
        with Session(self.engine) as session, session.begin():
            settled_before = db_now(session) - timedelta(seconds=settle_s)
            has_recent = select(Job.id).where(Job.batch_id == Batch.id,
                                              Job.created_at > settled_before)
            done = session.scalars(
                update(Batch)
                .where(Batch.status == BatchStatus.IN_PROGRESS, has_jobs.exists(),
                       ~has_active.exists(), ~has_recent.exists())
                .values(status=BatchStatus.COMPLETED, completed_at=to_dt(now_s))
                .returning(Batch.id)
            ).all()
        return list(done)

    def due_batches(self, now_s: float, limit: int = 100) -> list[str]:
        """Settled batches not yet finalized whose next webhook attempt (if any) is due."""
        with Session(self.engine) as session:
            return list(session.scalars(
                select(Batch.id).where(
                    Batch.status != BatchStatus.IN_PROGRESS, Batch.notified_at.is_(None),
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
