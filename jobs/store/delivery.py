"""The workers' writes: count each delivery and decide its fate, store outcomes, hand back."""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence

from sqlalchemy import Engine, case, func, select, update
from sqlalchemy.orm import Session

from jobs.models import Job
from jobs.schemas import JobStatus, Outcome
from jobs.store.transitions import (
    ACTIVE,
    EXPIRED_UNRUN,
    aware,
    terminalize,
    terminalize_many,
    to_dt,
)


class Decision(enum.Enum):
    """What a worker does with a delivered job (see :meth:`DeliveryStore.begin_deliveries`)."""

    RUN = "run"  # now running on this worker; attempts was incremented
    SKIP = "skip"  # already terminal (a duplicate delivery) or unknown: ack, do nothing
    DEAD = "dead"  # delivered too often: marked failed; move to the dead-letter stream
    EXPIRED = "expired"  # past its deadline: marked expired, not run
    CANCELLED = "cancelled"  # cancelled before it started: marked cancelled

    @property
    def status(self) -> JobStatus | None:
        """The terminal status the decision stored, if any."""
        return _DECISION_STATUS.get(self)


_DECISION_STATUS = {
    Decision.DEAD: JobStatus.FAILED,
    Decision.EXPIRED: JobStatus.EXPIRED,
    Decision.CANCELLED: JobStatus.CANCELLED,
}


class DeliveryStore:
    """A worker's view of its jobs: deliveries, outcomes, hand-backs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def begin_deliveries(
        self, job_ids: Sequence[str], worker_id: str, max_deliveries: int, now_s: float,
        live_workers: Collection[str] = (),
    ) -> dict[str, Decision]:
        """Count one delivery of each job to ``worker_id`` and decide its fate, in one
        transaction. Jobs decided RUN are ``running`` on ``worker_id`` afterwards.

        A job already ``running`` on another worker in ``live_workers`` is a second copy (a
        stolen lease, a reconciler duplicate): it is skipped without counting a delivery, so
        the copy neither runs it twice nor charges it an attempt. Terminal decisions count the
        delivery too, so ``attempts`` agrees with the error text."""
        if not job_ids:
            return {}
        decisions = {job_id: Decision.SKIP for job_id in job_ids}
        live = set(live_workers) - {worker_id}
        with Session(self.engine) as session, session.begin():
            rows = session.execute(
                select(Job.id, Job.status, Job.attempts, Job.cancel_requested, Job.deadline_at,
                       Job.worker_id)
                .where(Job.id.in_(set(job_ids)))
                .with_for_update()
            ).all()
            run: list[str] = []
            for row in rows:
                if row.status not in ACTIVE:
                    continue
                if row.status == JobStatus.RUNNING.value and row.worker_id in live:
                    continue  # runs on a live worker: this delivery is a duplicate
                attempts = row.attempts + 1
                deadline = aware(row.deadline_at)
                if row.cancel_requested:
                    outcome = Outcome(row.id, JobStatus.CANCELLED, now_s, error="cancelled")
                    decisions[row.id] = Decision.CANCELLED
                elif deadline is not None and deadline.timestamp() <= now_s:
                    outcome = Outcome(row.id, JobStatus.EXPIRED, now_s, error=EXPIRED_UNRUN)
                    decisions[row.id] = Decision.EXPIRED
                elif attempts > max_deliveries:
                    outcome = Outcome(
                        row.id, JobStatus.FAILED, now_s,
                        error=f"dead-lettered: delivered {attempts} times "
                              f"(limit {max_deliveries}) without finishing",
                    )
                    decisions[row.id] = Decision.DEAD
                else:
                    run.append(row.id)
                    decisions[row.id] = Decision.RUN
                    continue
                terminalize(session, outcome, worker_id=worker_id, attempts=attempts)
            if run:
                session.execute(
                    update(Job).where(Job.id.in_(run)).values(
                        status=JobStatus.RUNNING.value,
                        attempts=Job.attempts + 1,
                        worker_id=worker_id,
                        started_at=func.coalesce(Job.started_at, to_dt(now_s)),
                        # an entry added to the stream by other means than the feeder
                        fed_at=func.coalesce(Job.fed_at, to_dt(now_s)),
                    )
                )
        return decisions

    def finish(self, outcomes: Iterable[Outcome], worker_id: str | None = None) -> set[str]:
        """Store terminal outcomes in one transaction; return the ids that became terminal now
        (the others were terminal already and are left untouched)."""
        with Session(self.engine) as session, session.begin():
            return terminalize_many(session, list(outcomes), worker_id=worker_id)

    def release(self, job_ids: Sequence[str], worker_id: str) -> int:
        """Hand running jobs back to the queue without counting the attempt."""
        if not job_ids:
            return 0
        with Session(self.engine) as session, session.begin():
            res = session.execute(
                update(Job)
                .where(Job.id.in_(job_ids), Job.status == JobStatus.RUNNING.value,
                       Job.worker_id == worker_id)
                .values(status=JobStatus.QUEUED.value, worker_id=None,
                        attempts=case((Job.attempts > 0, Job.attempts - 1), else_=0))
            )
            return res.rowcount or 0
