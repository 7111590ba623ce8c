"""The reconciler's and the control plane's job writes: deadlines, reaping, retention.

Every method is idempotent: state changes are guarded by the rows' current status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

from sqlalchemy import Engine, delete, null, select, text, update
from sqlalchemy.orm import Session

from jobs.models import FED, Batch, Job, JobMetrics
from jobs.schemas import ENDED_BATCH, JobSpec, JobStatus
from jobs.store.feed import parse_specs
from jobs.store.transitions import ACTIVE, EXPIRED_ERROR, db_now, end_many, to_dt


class MaintenanceStore:
    """Finds jobs Redis lost, ends jobs past their deadline or delivery limit, purges old ones."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def active_jobs(self, model: str, older_than_s: float,
                    page_size: int = 1000) -> Iterator[list[tuple[str, str, str | None]]]:
        """Pages of (id, status, worker_id) of the queued/running jobs of ``model`` fed to its
        stream more than ``older_than_s`` ago by the database's clock, in id order (one query
        per page along the partial index ``ix_jobs_fed``: the backlog not yet fed is not read,
        however large)."""
        with Session(self.engine) as session:
            cutoff = db_now(session) - timedelta(seconds=older_than_s)
        after = ""
        while True:
            with Session(self.engine) as session:
                rows = session.execute(
                    select(Job.id, Job.status, Job.worker_id).where(
                        Job.model == model, text(FED), Job.fed_at < cutoff, Job.id > after,
                    ).order_by(Job.id).limit(page_size)
                ).all()
            if rows:
                yield [(r.id, r.status, r.worker_id) for r in rows]
            if len(rows) < page_size:
                return
            after = rows[-1].id

    def specs(self, job_ids: Sequence[str]) -> tuple[list[JobSpec], dict[str, str]]:
        """The jobs as submitted (what is enqueued again or dead-lettered), and the ids of those
        today's rules refuse (stored by an older kvbatch) with the reason: never an exception
        that would stop a reconciler or reaper pass."""
        with Session(self.engine) as session:
            rows = session.execute(select(Job.id, Job.spec).where(Job.id.in_(job_ids))).all()
        return parse_specs(rows)

    def fail(self, errors: dict[str, str], now_s: float) -> list[str]:
        """Fail the active jobs among ``errors`` (id -> reason); return those failed now."""
        if not errors:
            return []
        with Session(self.engine) as session, session.begin():
            rows = session.execute(
                select(Job.id, Job.status).where(Job.id.in_(list(errors)),
                                                 Job.status.in_(ACTIVE)).with_for_update()
            ).all()
            ended = end_many(session, [(r.id, r.status, errors[r.id]) for r in rows],
                             JobStatus.FAILED, now_s)
        return [job_id for job_id, _ in ended]

    def expire_past_deadline(self, now_s: float, *, running_grace_s: float | None = None,
                             model: str | None = None,
                             limit: int = 1000) -> list[tuple[str, str]]:
        """Expire up to ``limit`` jobs (of ``model``, else of every model) whose deadline
        passed: queued ones at once; running ones ``running_grace_s`` later (their worker
        aborts them itself at the deadline; past the grace it is presumably gone), or never
        when it is None. Returns (id, status before) of each job expired now; call again
        while it returns ``limit`` jobs."""
        due = (Job.status == JobStatus.QUEUED.value) & (Job.deadline_at <= to_dt(now_s))
        if running_grace_s is not None:
            due |= ((Job.status == JobStatus.RUNNING.value)
                    & (Job.deadline_at <= to_dt(now_s - running_grace_s)))
        query = select(Job.id, Job.status).where(Job.deadline_at.is_not(None), due)
        if model is not None:
            query = query.where(Job.model == model)
        with Session(self.engine) as session, session.begin():
            rows = session.execute(query.limit(limit).with_for_update(skip_locked=True)).all()
            return end_many(session, [(r.id, r.status, EXPIRED_ERROR[r.status]) for r in rows],
                            JobStatus.EXPIRED, now_s)

    def reap_overdelivered(self, max_deliveries: int, live_workers: Callable[[], set[str]],
                           now_s: float, limit: int = 1000,
                           after_id: str = "") -> tuple[list[tuple[str, str, int]], str | None]:
        """Fail active jobs that used up their deliveries and are on no live worker: queued, or
        running on a worker whose heartbeat is gone. Their next delivery would dead-letter them;
        this does it when no worker is left to pull them. Looks at ``limit`` candidates with ids
        after ``after_id``; ``live_workers()`` is asked after they are locked, so a worker that
        took one of them just before still counts as live. Returns (id, model, attempts) of the
        reaped jobs, and the ``after_id`` of the next page (None: no more candidates)."""
        with Session(self.engine) as session, session.begin():
            rows = session.execute(
                select(Job.id, Job.model, Job.status, Job.attempts, Job.worker_id)
                .where(Job.status.in_(ACTIVE), Job.attempts >= max_deliveries,
                       Job.id > after_id)
                .order_by(Job.id).limit(limit).with_for_update(skip_locked=True)
            ).all()
            if not rows:
                return [], None
            live = live_workers() if any(r.status == JobStatus.RUNNING.value
                                         for r in rows) else set()
            candidates = {
                row.id: row for row in rows
                # A running job on a live worker: its last allowed delivery is still running.
                if not (row.status == JobStatus.RUNNING.value and row.worker_id in live)
            }
            ended = end_many(session, [
                (row.id, row.status, f"dead-lettered: delivered {row.attempts} times (limit "
                                     f"{max_deliveries}) without finishing; reaped by the "
                                     f"control plane")
                for row in candidates.values()], JobStatus.FAILED, now_s)
            reaped = [(job_id, candidates[job_id].model, candidates[job_id].attempts)
                      for job_id, _ in ended]
            return reaped, (rows[-1].id if len(rows) == limit else None)

    def purge_results(self, finished_before_s: float, limit: int = 1000) -> int:
        """Drop the result payload (text, token ids, logprobs, choices, embeddings) of up to
        ``limit`` terminal jobs finished before then; rows and their stats stay for the
        dashboards."""
        with Session(self.engine) as session, session.begin():
            ids = session.scalars(
                select(Job.id).where(
                    Job.finished_at < to_dt(finished_before_s),
                    Job.status.not_in(ACTIVE),
                    Job.text.is_not(None) | Job.token_ids.is_not(None),
                ).limit(limit)
            ).all()
            if not ids:
                return 0
            session.execute(
                update(Job).where(Job.id.in_(ids)).values(
                    text=null(), token_ids=null(), logprobs=null(), choices=null(),
                    embeddings=null(),
                )
            )
            return len(ids)

    def delete_finished(self, finished_before_s: float, limit: int = 1000) -> int:
        """Delete up to ``limit`` terminal jobs finished before then (their stats go with
        them), then batches that are settled and have no job left."""
        with Session(self.engine) as session, session.begin():
            ids = session.scalars(
                select(Job.id).where(Job.finished_at < to_dt(finished_before_s),
                                     Job.status.not_in(ACTIVE)).limit(limit)
            ).all()
            if ids:
                session.execute(delete(JobMetrics).where(JobMetrics.job_id.in_(ids)))
                session.execute(delete(Job).where(Job.id.in_(ids)))
            session.execute(
                delete(Batch).where(
                    Batch.status.in_(ENDED_BATCH), Batch.notified_at.is_not(None),
                    Batch.completed_at < to_dt(finished_before_s),
                    ~select(Job.id).where(Job.batch_id == Batch.id).exists(),
                )
            )
            return len(ids)
