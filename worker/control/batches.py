"""Batch rows through their lifecycle: ``in_progress`` → ``completed`` (every job terminal) or
``expired`` (deadline passed, in ``JobStore.expire_batches``), then finalized: results file
exported, completion event published, webhook delivered or given up, ``notified_at`` set.

Every step is guarded by the row's state, so running it twice changes nothing the second time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from jobs.models import BATCH_COMPLETED, BATCH_IN_PROGRESS, Batch, Job
from jobs.schemas import ACTIVE_STATUSES
from jobs.store import JobStore, db_now, to_dt

_ACTIVE = [s.value for s in ACTIVE_STATUSES]
EXPORT_CHUNK = 500


@dataclass(frozen=True)
class BatchState:
    id: str
    model: str
    status: str
    num_jobs: int
    completed_at: datetime | None
    webhook_url: str | None
    webhook_attempts: int
    webhook_next_at: datetime | None
    results_path: str | None
    notified_at: datetime | None


def complete_batches(engine: Engine, now_s: float, settle_s: float) -> list[str]:
    """Mark ``completed`` every in-progress batch whose jobs are all terminal and that got no
    new job for ``settle_s`` (a producer may still be adding chunks of a large dataset).
    ``created_at`` is stamped by the database's clock, so the settle time is measured on it."""
    has_active = select(Job.id).where(Job.batch_id == Batch.id, Job.status.in_(_ACTIVE))
    has_jobs = select(Job.id).where(Job.batch_id == Batch.id)
    with Session(engine) as session, session.begin():
        settled_before = db_now(session) - timedelta(seconds=settle_s)
        has_recent = select(Job.id).where(Job.batch_id == Batch.id,
                                          Job.created_at > settled_before)
        done = session.scalars(
            update(Batch)
            .where(Batch.status == BATCH_IN_PROGRESS, has_jobs.exists(),
                   ~has_active.exists(), ~has_recent.exists())
            .values(status=BATCH_COMPLETED, completed_at=to_dt(now_s))
            .returning(Batch.id)
        ).all()
    return list(done)


def due_batches(engine: Engine, now_s: float, limit: int = 100) -> list[str]:
    """Settled batches not yet finalized whose next webhook attempt (if any) is due."""
    with Session(engine) as session:
        return list(session.scalars(
            select(Batch.id).where(
                Batch.status != BATCH_IN_PROGRESS, Batch.notified_at.is_(None),
                Batch.webhook_next_at.is_(None) | (Batch.webhook_next_at <= to_dt(now_s)),
            ).order_by(Batch.completed_at).limit(limit)
        ))


def load(engine: Engine, batch_id: str) -> BatchState | None:
    with Session(engine) as session:
        b = session.get(Batch, batch_id)
        if b is None:
            return None
        return BatchState(
            id=b.id, model=b.model, status=b.status, num_jobs=b.num_jobs,
            completed_at=_utc(b.completed_at), webhook_url=b.webhook_url,
            webhook_attempts=b.webhook_attempts, webhook_next_at=_utc(b.webhook_next_at),
            results_path=b.results_path, notified_at=_utc(b.notified_at),
        )


def event(store: JobStore, batch: BatchState, results_path: str | None) -> dict[str, Any]:
    """The completion event, as published on Redis and POSTed to the webhook."""
    counts = store.count_by_status(batch_id=batch.id)
    completed_at = batch.completed_at
    return {
        "type": f"batch.{batch.status}",
        "batch_id": batch.id,
        "model": batch.model,
        "status": batch.status,
        "num_jobs": batch.num_jobs,
        "counts": {status.value: n for status, n in sorted(counts.items())},
        "completed_at": completed_at.isoformat() if completed_at else None,
        "results_path": results_path,
    }


def export_results(store: JobStore, batch_id: str, export_dir: str) -> str:
    """Write every job of the batch (as ``JobInfo`` JSON, one per line, by job id) to
    ``<export_dir>/<batch_id>.jsonl``; the file appears complete or not at all."""
    directory = Path(export_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{batch_id}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    last = ""
    with open(tmp, "w", encoding="utf-8") as out:
        while True:
            with Session(store.engine) as session:
                ids = list(session.scalars(
                    select(Job.id).where(Job.batch_id == batch_id, Job.id > last)
                    .order_by(Job.id).limit(EXPORT_CHUNK)
                ))
            for info in sorted(store.get_many(ids), key=lambda i: i.id):
                out.write(info.model_dump_json() + "\n")
            if len(ids) < EXPORT_CHUNK:
                break
            last = ids[-1]
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    return str(path)


def record_export(engine: Engine, batch_id: str, path: str) -> None:
    _set(engine, batch_id, results_path=path)


def record_webhook_attempt(engine: Engine, batch_id: str, now_s: float, error: str | None,
                           max_attempts: int, retry_in_s: float,
                           delivered: bool | None = None) -> bool:
    """Count one finalization attempt (export or webhook) with its error, if any; True when
    the batch is now finalized: delivered (default: no error), or the last attempt failed."""
    delivered = error is None if delivered is None else delivered
    with Session(engine) as session, session.begin():
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


def mark_notified(engine: Engine, batch_id: str, now_s: float) -> None:
    _set(engine, batch_id, notified_at=to_dt(now_s))


def configure(engine: Engine, batch_id: str, *, webhook_url: str | None = None,
              deadline_s: float | None = None) -> None:
    """Set a batch's own webhook and deadline (the batch row must exist)."""
    JobStore(engine).configure_batch(
        batch_id, webhook_url=webhook_url,
        deadline=to_dt(deadline_s) if deadline_s is not None else None,
    )


def _set(engine: Engine, batch_id: str, **values: Any) -> None:
    with Session(engine) as session, session.begin():
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))


def _utc(dt: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; everything stored is UTC.
    return dt.replace(tzinfo=UTC) if dt is not None and dt.tzinfo is None else dt
