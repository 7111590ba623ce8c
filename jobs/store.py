"""The SQL system of record: every job state change is one transaction here.

Invariants:
  * A job row exists from submission on; Redis only ever holds copies of queued jobs.
  * Terminal transitions are guarded by ``status IN ('queued', 'running')``, so however often a
    job is delivered, exactly one transition (and one ``job_metrics`` row) wins.
  * ``attempts`` counts deliveries to workers; a voluntary hand-back (graceful shutdown) gives
    the attempt back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, case, delete, func, insert, null, select, update
from sqlalchemy.orm import Session

from jobs.models import BATCH_EXPIRED, BATCH_IN_PROGRESS, Batch, Job, JobMetrics
from jobs.schemas import (
    ACTIVE_STATUSES,
    Choice,
    JobInfo,
    JobResult,
    JobSpec,
    JobStats,
    JobStatus,
    Usage,
)

_ACTIVE = [s.value for s in ACTIVE_STATUSES]
_EXPIRED_UNRUN = "deadline passed before the job ran"
_EXPIRED_ERROR = {
    JobStatus.QUEUED.value: _EXPIRED_UNRUN,
    JobStatus.RUNNING.value: "deadline passed while running (worker did not report back)",
}


def to_dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _aware(dt: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; everything stored is UTC.
    return dt.replace(tzinfo=UTC) if dt is not None and dt.tzinfo is None else dt


def db_now(session: Session) -> datetime:
    """The database server's clock (UTC), so that ages compare against one clock however
    skewed producers' and workers' clocks are."""
    if session.get_bind().dialect.name == "sqlite":  # CURRENT_TIMESTAMP has whole seconds
        stamp = session.scalar(select(func.strftime("%Y-%m-%d %H:%M:%f", "now")))
        return datetime.fromisoformat(str(stamp)).replace(tzinfo=UTC)
    value = session.scalar(select(func.now()))
    assert isinstance(value, datetime)
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


class Decision(enum.Enum):
    """What a worker does with a delivered job (see :meth:`JobStore.begin_deliveries`)."""

    RUN = "run"  # now running on this worker; attempts was incremented
    SKIP = "skip"  # already terminal (a duplicate delivery) or unknown: ack, do nothing
    DEAD = "dead"  # delivered too often: marked failed; move to the dead-letter stream
    EXPIRED = "expired"  # past its deadline: marked expired, not run
    CANCELLED = "cancelled"  # cancelled before it started: marked cancelled


@dataclass(frozen=True)
class Outcome:
    """A job's terminal state as the worker reports it."""

    job_id: str
    status: JobStatus
    finished_at: float
    error: str | None = None
    result: JobResult | None = None
    stats: JobStats | None = None


class JobStore:
    """Job rows in SQL. Thread-safe to the extent the SQLAlchemy engine is (each call is its
    own session and transaction)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # -- producers ---------------------------------------------------------------------------

    def insert_jobs(self, specs: Sequence[JobSpec]) -> None:
        """Insert ``specs`` as queued jobs in one transaction (creating missing batch rows)."""
        if not specs:
            return
        with Session(self.engine) as session, session.begin():
            now = db_now(session)
            batch_ids = {s.batch_id for s in specs if s.batch_id is not None}
            if batch_ids:
                known = set(session.scalars(select(Batch.id).where(Batch.id.in_(batch_ids))))
                for batch_id in sorted(batch_ids - known):
                    first = next(s for s in specs if s.batch_id == batch_id)
                    session.add(Batch(id=batch_id, model=first.model, meta={},
                                      created_at=now, num_jobs=0))
                session.flush()
                for batch_id in batch_ids:
                    n = sum(1 for s in specs if s.batch_id == batch_id)
                    session.execute(update(Batch).where(Batch.id == batch_id)
                                    .values(num_jobs=Batch.num_jobs + n))
            session.execute(insert(Job), [_job_row(s, now) for s in specs])

    def configure_batch(self, batch_id: str, *, webhook_url: str | None = None,
                        deadline: datetime | None = None) -> None:
        """Set a batch's completion webhook and its deadline (the batch row must exist)."""
        values: dict[str, Any] = {}
        if webhook_url is not None:
            values["webhook_url"] = webhook_url
        if deadline is not None:
            values["deadline_at"] = deadline if deadline.tzinfo else deadline.replace(tzinfo=UTC)
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
                _terminalize(session, Outcome(job_id, JobStatus.CANCELLED, now_s,
                                              error="cancelled before it started"))
                return JobStatus.CANCELLED
            if status is JobStatus.RUNNING:
                session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
            return status

    # -- workers -----------------------------------------------------------------------------

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
                if row.status not in _ACTIVE:
                    continue
                if row.status == JobStatus.RUNNING.value and row.worker_id in live:
                    continue  # runs on a live worker: this delivery is a duplicate
                attempts = row.attempts + 1
                deadline = _aware(row.deadline_at)
                if row.cancel_requested:
                    outcome = Outcome(row.id, JobStatus.CANCELLED, now_s, error="cancelled")
                    decisions[row.id] = Decision.CANCELLED
                elif deadline is not None and deadline.timestamp() <= now_s:
                    outcome = Outcome(row.id, JobStatus.EXPIRED, now_s, error=_EXPIRED_UNRUN)
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
                _terminalize(session, outcome, worker_id=worker_id, attempts=attempts)
            if run:
                session.execute(
                    update(Job).where(Job.id.in_(run)).values(
                        status=JobStatus.RUNNING.value,
                        attempts=Job.attempts + 1,
                        worker_id=worker_id,
                        started_at=func.coalesce(Job.started_at, to_dt(now_s)),
                    )
                )
        return decisions

    def finish(self, outcomes: Iterable[Outcome], worker_id: str | None = None) -> set[str]:
        """Store terminal outcomes in one transaction; return the ids that became terminal now
        (the others were terminal already and are left untouched)."""
        done: set[str] = set()
        with Session(self.engine) as session, session.begin():
            for outcome in outcomes:
                if _terminalize(session, outcome, worker_id=worker_id):
                    done.add(outcome.job_id)
        return done

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

    # -- reconciler --------------------------------------------------------------------------

    def active_jobs(self, model: str, older_than_s: float,
                    page_size: int = 1000) -> Iterator[list[tuple[str, str, str | None]]]:
        """Pages of (id, status, worker_id) of queued/running jobs of ``model`` created more
        than ``older_than_s`` ago by the database's clock, in id order (one query per page)."""
        with Session(self.engine) as session:
            cutoff = db_now(session) - timedelta(seconds=older_than_s)
        after = ""
        while True:
            with Session(self.engine) as session:
                rows = session.execute(
                    select(Job.id, Job.status, Job.worker_id).where(
                        Job.model == model, Job.status.in_(_ACTIVE),
                        Job.created_at < cutoff, Job.id > after,
                    ).order_by(Job.id).limit(page_size)
                ).all()
            if rows:
                yield [(r.id, r.status, r.worker_id) for r in rows]
            if len(rows) < page_size:
                return
            after = rows[-1].id

    def specs(self, job_ids: Sequence[str]) -> list[JobSpec]:
        with Session(self.engine) as session:
            rows = session.scalars(select(Job.spec).where(Job.id.in_(job_ids))).all()
        return [JobSpec.model_validate(r) for r in rows]

    def expire_overdue(self, model: str, now_s: float) -> list[str]:
        """Mark queued jobs of ``model`` whose deadline passed as expired; return their ids."""
        with Session(self.engine) as session, session.begin():
            ids = session.scalars(
                select(Job.id).where(
                    Job.model == model, Job.status == JobStatus.QUEUED.value,
                    Job.deadline_at.is_not(None), Job.deadline_at <= to_dt(now_s),
                ).with_for_update()
            ).all()
            return [
                job_id for job_id in ids
                if _terminalize(session, Outcome(job_id, JobStatus.EXPIRED, now_s,
                                                 error=_EXPIRED_UNRUN))
            ]

    # -- control plane (worker/control/) ------------------------------------------------------

    def expire_past_deadline(self, now_s: float, running_grace_s: float,
                             limit: int = 1000) -> list[tuple[str, str]]:
        """Expire up to ``limit`` jobs of every model whose deadline passed: queued ones at
        once, running ones ``running_grace_s`` later (their worker aborts them itself at the
        deadline; past the grace it is presumably gone). Returns (id, status before) of each job
        expired now; call again while it returns ``limit`` jobs."""
        queued_cut, running_cut = to_dt(now_s), to_dt(now_s - running_grace_s)
        with Session(self.engine) as session, session.begin():
            rows = session.execute(
                select(Job.id, Job.status).where(
                    Job.deadline_at.is_not(None),
                    ((Job.status == JobStatus.QUEUED.value) & (Job.deadline_at <= queued_cut))
                    | ((Job.status == JobStatus.RUNNING.value)
                       & (Job.deadline_at <= running_cut)),
                ).limit(limit).with_for_update(skip_locked=True)
            ).all()
            return _end_many(session, [(r.id, r.status, _EXPIRED_ERROR[r.status]) for r in rows],
                             JobStatus.EXPIRED, now_s)

    def expire_batches(self, now_s: float, limit: int = 1000) -> dict[str, list[tuple[str, str]]]:
        """Batches still in progress whose deadline passed become ``expired`` with every active
        job in them. ``limit`` jobs per transaction; the batch's status changes in the
        transaction that expires its last active jobs, so a crash midway leaves it in progress
        (and past its deadline: the next run carries on). Returns batch id -> (job id, status
        before)."""
        with Session(self.engine) as session:
            batch_ids = session.scalars(
                select(Batch.id).where(Batch.status == BATCH_IN_PROGRESS,
                                       Batch.deadline_at.is_not(None),
                                       Batch.deadline_at <= to_dt(now_s))
            ).all()
        expired: dict[str, list[tuple[str, str]]] = {}
        for batch_id in batch_ids:
            done: list[tuple[str, str]] = []
            while True:
                with Session(self.engine) as session, session.begin():
                    rows = session.execute(
                        select(Job.id, Job.status)
                        .where(Job.batch_id == batch_id, Job.status.in_(_ACTIVE))
                        .order_by(Job.id).limit(limit).with_for_update()
                    ).all()
                    done += _end_many(session, [(r.id, r.status, "batch deadline passed")
                                                for r in rows], JobStatus.EXPIRED, now_s)
                    if len(rows) < limit:
                        res = session.execute(
                            update(Batch)
                            .where(Batch.id == batch_id, Batch.status == BATCH_IN_PROGRESS)
                            .values(status=BATCH_EXPIRED, completed_at=to_dt(now_s))
                        )
                        if res.rowcount == 1:
                            expired[batch_id] = done
                        break
        return expired

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
                .where(Job.status.in_(_ACTIVE), Job.attempts >= max_deliveries,
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
            ended = _end_many(session, [
                (row.id, row.status, f"dead-lettered: delivered {row.attempts} times (limit "
                                     f"{max_deliveries}) without finishing; reaped by the "
                                     f"control plane")
                for row in candidates.values()], JobStatus.FAILED, now_s)
            reaped = [(job_id, candidates[job_id].model, candidates[job_id].attempts)
                      for job_id, _ in ended]
            return reaped, (rows[-1].id if len(rows) == limit else None)

    def purge_results(self, finished_before_s: float, limit: int = 1000) -> int:
        """Drop the result payload (text, token ids, logprobs, choices) of up to ``limit``
        terminal jobs finished before then; rows and their stats stay for the dashboards."""
        with Session(self.engine) as session, session.begin():
            ids = session.scalars(
                select(Job.id).where(
                    Job.finished_at < to_dt(finished_before_s),
                    Job.status.not_in(_ACTIVE),
                    Job.text.is_not(None) | Job.token_ids.is_not(None),
                ).limit(limit)
            ).all()
            if not ids:
                return 0
            session.execute(
                update(Job).where(Job.id.in_(ids)).values(
                    text=null(), token_ids=null(), logprobs=null(), choices=null()
                )
            )
            return len(ids)

    def delete_finished(self, finished_before_s: float, limit: int = 1000) -> int:
        """Delete up to ``limit`` terminal jobs finished before then (their stats go with
        them), then batches that are settled and have no job left."""
        with Session(self.engine) as session, session.begin():
            ids = session.scalars(
                select(Job.id).where(Job.finished_at < to_dt(finished_before_s),
                                     Job.status.not_in(_ACTIVE)).limit(limit)
            ).all()
            if ids:
                session.execute(delete(JobMetrics).where(JobMetrics.job_id.in_(ids)))
                session.execute(delete(Job).where(Job.id.in_(ids)))
            session.execute(
                delete(Batch).where(
                    Batch.status != BATCH_IN_PROGRESS, Batch.notified_at.is_not(None),
                    Batch.completed_at < to_dt(finished_before_s),
                    ~select(Job.id).where(Job.batch_id == Batch.id).exists(),
                )
            )
            return len(ids)

    # -- readers -----------------------------------------------------------------------------

    def get(self, job_id: str) -> JobInfo | None:
        infos = self.get_many([job_id])
        return infos[0] if infos else None

    def get_many(self, job_ids: Sequence[str]) -> list[JobInfo]:
        with Session(self.engine) as session:
            rows = session.execute(
                select(Job, JobMetrics)
                .outerjoin(JobMetrics, JobMetrics.job_id == Job.id)
                .where(Job.id.in_(job_ids))
            ).all()
        return [_info(job, metrics) for job, metrics in rows]

    def batch_jobs(self, batch_id: str) -> list[tuple[str, str | None, JobStatus]]:
        """(id, custom_id, status) of every job of ``batch_id``."""
        with Session(self.engine) as session:
            rows = session.execute(
                select(Job.id, Job.custom_id, Job.status).where(Job.batch_id == batch_id)
            ).all()
        return [(r.id, r.custom_id, JobStatus(r.status)) for r in rows]

    def terminal_ids(self, job_ids: Sequence[str], chunk: int = 1000) -> set[str]:
        """Which of ``job_ids`` are terminal (one query per ``chunk`` ids)."""
        done: set[str] = set()
        with Session(self.engine) as session:
            for start in range(0, len(job_ids), chunk):
                done.update(session.scalars(
                    select(Job.id).where(Job.id.in_(job_ids[start:start + chunk]),
                                         Job.status.not_in(_ACTIVE))
                ))
        return done

    def count_by_status(self, model: str | None = None,
                        batch_id: str | None = None) -> dict[JobStatus, int]:
        query = select(Job.status, func.count()).group_by(Job.status)
        if model is not None:
            query = query.where(Job.model == model)
        if batch_id is not None:
            query = query.where(Job.batch_id == batch_id)
        with Session(self.engine) as session:
            return {JobStatus(s): n for s, n in session.execute(query).all()}


def _job_row(spec: JobSpec, created_at: datetime) -> dict[str, Any]:
    return {
        "id": spec.id,
        "batch_id": spec.batch_id,
        "custom_id": spec.custom_id,
        "model": spec.model,
        "status": JobStatus.QUEUED.value,
        "priority": spec.priority,
        "spec": spec.model_dump(mode="json"),
        "meta": spec.metadata,
        "created_at": created_at,  # the database's clock: the reconciler's grace uses it
        "deadline_at": spec.deadline,
        "attempts": 0,
        "cancel_requested": False,
    }


def _terminalize(session: Session, outcome: Outcome, worker_id: str | None = None,
                 attempts: int | None = None) -> bool:
    """Move one active job to its terminal state with its metrics row; False if it was not
    active (someone else finished it first)."""
    values: dict[str, Any] = {
        "status": outcome.status.value,
        "finished_at": to_dt(outcome.finished_at),
        "error": _text(outcome.error),
    }
    if worker_id is not None:
        values["worker_id"] = worker_id
    if attempts is not None:
        values["attempts"] = attempts
    result = outcome.result
    if result is not None:
        values.update(
            text=_text(result.text),
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            logprobs=result.logprobs,
            choices=[c.model_dump(mode="json") for c in result.choices] or None,
        )
    res = session.execute(
        update(Job).where(Job.id == outcome.job_id, Job.status.in_(_ACTIVE)).values(**values)
    )
    if res.rowcount != 1:
        return False
    stats = outcome.stats or JobStats()
    session.execute(insert(JobMetrics).values(job_id=outcome.job_id, **stats.model_dump()))
    return True


def _end_many(session: Session, rows: Sequence[tuple[str, str, str]], status: JobStatus,
              now_s: float) -> list[tuple[str, str]]:
    """Move many active jobs, given as (id, status before, error), to ``status`` with a
    metrics row each, in a few statements (one per distinct error, one insert); the control
    plane's bulk counterpart of :func:`_terminalize`. Returns (id, status before) of the jobs
    that were still active."""
    before = {job_id: prior for job_id, prior, _ in rows}
    by_error: dict[str, list[str]] = {}
    for job_id, _, error in rows:
        by_error.setdefault(error, []).append(job_id)
    ended: list[str] = []
    for error, ids in by_error.items():
        ended += session.scalars(
            update(Job).where(Job.id.in_(ids), Job.status.in_(_ACTIVE))
            .values(status=status.value, finished_at=to_dt(now_s), error=_text(error))
            .returning(Job.id).execution_options(synchronize_session=False)
        ).all()
    if ended:
        empty = JobStats().model_dump()
        session.execute(insert(JobMetrics), [{"job_id": job_id, **empty} for job_id in ended])
    return sorted((job_id, before[job_id]) for job_id in ended)


def _text(value: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL; a model may emit it. token_ids keep the exact output.
    return value.replace("\x00", "\ufffd") if value is not None else None


def _info(job: Job, metrics: JobMetrics | None) -> JobInfo:
    status = JobStatus(job.status)
    result = stats = None
    if metrics is not None:
        stats = JobStats(
            queue_wait_s=metrics.queue_wait_s, ttft_s=metrics.ttft_s, tpot_s=metrics.tpot_s,
            e2e_s=metrics.e2e_s, prompt_tokens=metrics.prompt_tokens,
            cached_prompt_tokens=metrics.cached_prompt_tokens,
            generated_tokens=metrics.generated_tokens, peak_kv_blocks=metrics.peak_kv_blocks,
            peak_kv_bytes=metrics.peak_kv_bytes, preemptions=metrics.preemptions,
        )
    if job.text is not None or job.token_ids is not None:
        result = JobResult(
            text=job.text or "",
            token_ids=job.token_ids or [],
            finish_reason=job.finish_reason,
            logprobs=job.logprobs,
            usage=Usage(
                prompt_tokens=stats.prompt_tokens if stats else 0,
                cached_prompt_tokens=stats.cached_prompt_tokens if stats else 0,
                completion_tokens=stats.generated_tokens if stats else 0,
            ),
            choices=[Choice.model_validate(c) for c in job.choices or []],
        )
    return JobInfo(
        id=job.id, batch_id=job.batch_id, custom_id=job.custom_id, model=job.model,
        status=status, priority=job.priority, metadata=job.meta or {},
        created_at=_aware(job.created_at), started_at=_aware(job.started_at),
        finished_at=_aware(job.finished_at), deadline=_aware(job.deadline_at),
        attempts=job.attempts, worker_id=job.worker_id, error=job.error,
        result=result, stats=stats,
    )
