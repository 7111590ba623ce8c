"""Reads: jobs as :class:`JobInfo`, batch membership and counts, and the ``job_stats`` rows that
the statistics and the CLI tables are computed from."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import DateTime, Engine, bindparam, func, select, text, true
from sqlalchemy.orm import Session, defer

from jobs.models import Batch, Job, JobMetrics
from jobs.schemas import (
    TERMINAL_STATUSES,
    Choice,
    JobInfo,
    JobResult,
    JobStats,
    JobStatus,
    Usage,
)
from jobs.store.transitions import ACTIVE, aware

# The job_stats view's rows with the job's custom_id and submission time. The stats columns
# are JobStats' fields: the view carries every one of them (a parity test holds it to that).
JOB_STATS_QUERY = f"""
SELECT s.job_id, j.custom_id, s.status, {", ".join(f"s.{name}" for name in JobStats.model_fields)},
       s.worker_id, j.created_at, s.finished_at
FROM job_stats s JOIN jobs j ON j.id = s.job_id
WHERE {{where}}
ORDER BY s.finished_at, s.job_id
"""


class JobReader:
    """Read-only queries over jobs, batches and their statistics."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, job_id: str) -> JobInfo | None:
        """The stored job ``job_id`` (None if unknown)."""
        infos = self.get_many([job_id])
        return infos[0] if infos else None

    def get_many(self, job_ids: Sequence[str]) -> list[JobInfo]:
        """The stored jobs among ``job_ids`` (unknown ids are left out), in no set order."""
        with Session(self.engine) as session:
            rows = session.execute(
                select(Job, JobMetrics, _NAMED_MODEL)
                .options(defer(Job.spec))  # the request: not read here (but its model)
                .outerjoin(JobMetrics, JobMetrics.job_id == Job.id)
                .where(Job.id.in_(job_ids))
            ).all()
        return [_info(job, metrics, named) for job, metrics, named in rows]

    def batch_rows(self, batch_id: str, *, succeeded: bool | None = None,
                   fetch_rows: int = 16) -> Iterator[JobInfo]:
        """``batch_id``'s jobs in id order, one at a time: all of them, or with ``succeeded``
        the terminal ones that succeeded (True) or did not (False): what exports are made of.
        One query, fetched ``fetch_rows`` rows at a time (a server-side cursor on PostgreSQL),
        so memory holds that many results whatever the batch's size."""
        wanted = (Job.status == JobStatus.SUCCEEDED.value if succeeded else
                  Job.status.in_([s.value for s in TERMINAL_STATUSES - {JobStatus.SUCCEEDED}])
                  if succeeded is not None else true())
        with Session(self.engine) as session:
            rows = session.execute(
                select(Job, JobMetrics, _NAMED_MODEL).options(defer(Job.spec))
                .outerjoin(JobMetrics, JobMetrics.job_id == Job.id)
                .where(Job.batch_id == batch_id, wanted).order_by(Job.id)
                .execution_options(yield_per=fetch_rows))
            for job, metrics, named in rows:
                yield _info(job, metrics, named)

    def batch_jobs(self, batch_id: str) -> list[tuple[str, str | None, JobStatus]]:
        """(id, custom_id, status) of every job of ``batch_id``."""
        with Session(self.engine) as session:
            rows = session.execute(
                select(Job.id, Job.custom_id, Job.status).where(Job.batch_id == batch_id)
            ).all()
        return [(r.id, r.custom_id, JobStatus(r.status)) for r in rows]

    def owned_job_ids(self, owner: str, job_ids: Sequence[str], chunk: int = 1000) -> set[str]:
        """Those of ``job_ids`` in batches of tenant ``owner`` (one query per ``chunk``)."""
        found: set[str] = set()
        with Session(self.engine) as session:
            for start in range(0, len(job_ids), chunk):
                found.update(session.scalars(
                    select(Job.id).join(Batch, Batch.id == Job.batch_id).where(
                        Batch.owner == owner, Job.id.in_(job_ids[start:start + chunk]))))
        return found

    def batch_job_ids_of(self, batch_id: str, custom_ids: Sequence[str],
                         chunk: int = 1000) -> dict[str, str]:
        """``custom_id`` -> job id of those of ``custom_ids`` that batch ``batch_id`` holds
        (one query per ``chunk`` ids)."""
        found: dict[str, str] = {}
        with Session(self.engine) as session:
            for start in range(0, len(custom_ids), chunk):
                found.update((r.custom_id, r.id) for r in session.execute(
                    select(Job.custom_id, Job.id).where(
                        Job.batch_id == batch_id,
                        Job.custom_id.in_(custom_ids[start:start + chunk]))))
        return found

    def batch_model(self, batch_id: str) -> str | None:
        """The model of batch ``batch_id`` (None if there is no such batch)."""
        with Session(self.engine) as session:
            return session.scalar(select(Batch.model).where(Batch.id == batch_id))

    def batch_settings(self, batch_id: str) -> tuple[str | None, datetime | None] | None:
        """(webhook URL, deadline) of batch ``batch_id``; None when there is no such batch."""
        with Session(self.engine) as session:
            row = session.execute(
                select(Batch.webhook_url, Batch.deadline_at).where(Batch.id == batch_id)
            ).first()
        return None if row is None else (row.webhook_url, aware(row.deadline_at))

    def terminal_ids(self, job_ids: Sequence[str], chunk: int = 1000) -> set[str]:
        """Which of ``job_ids`` are terminal (one query per ``chunk`` ids)."""
        done: set[str] = set()
        with Session(self.engine) as session:
            for start in range(0, len(job_ids), chunk):
                done.update(session.scalars(
                    select(Job.id).where(Job.id.in_(job_ids[start:start + chunk]),
                                         Job.status.not_in(ACTIVE))
                ))
        return done

    def count_by_status(self, model: str | None = None,
                        batch_id: str | None = None) -> dict[JobStatus, int]:
        """How many jobs (of ``model``, of ``batch_id``) are in each status; statuses without
        jobs are absent."""
        query = select(Job.status, func.count()).group_by(Job.status)
        if model is not None:
            query = query.where(Job.model == model)
        if batch_id is not None:
            query = query.where(Job.batch_id == batch_id)
        with Session(self.engine) as session:
            return {JobStatus(s): n for s, n in session.execute(query).all()}

    def job_stats_rows(self, batch_id: str | None = None,
                       since: datetime | timedelta | None = None) -> list[dict[str, Any]]:
        """Rows of the ``job_stats`` view (plus ``custom_id`` and ``created_at``), by finish
        time.

        Args:
            batch_id: only this batch's jobs.
            since: only jobs finished after this time (a ``timedelta`` counts back from now).
        """
        where: list[str] = ["1 = 1"]
        params: dict[str, Any] = {}
        if batch_id is not None:
            where.append("s.batch_id = :batch_id")
            params["batch_id"] = batch_id
        if since is not None:
            if isinstance(since, timedelta):
                since = datetime.now(UTC) - since
            where.append("s.finished_at >= :since")
            params["since"] = since if since.tzinfo else since.replace(tzinfo=UTC)
        query = text(JOB_STATS_QUERY.format(where=" AND ".join(where))).columns(
            created_at=DateTime(timezone=True), finished_at=DateTime(timezone=True))
        if since is not None:  # bound as the column type, so SQLite compares like with like
            query = query.bindparams(bindparam("since", type_=DateTime(timezone=True)))
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query, params)]


# The model the job named: its ``model`` column is its queue's (``queue_model``: a LoRA
# adapter's jobs wait in their base model's queue).
_NAMED_MODEL = Job.spec["model"].as_string()


def _info(job: Job, metrics: JobMetrics | None, named_model: str | None = None) -> JobInfo:
    stats = JobStats.model_validate(metrics, from_attributes=True) if metrics else None
    result = None
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
            embeddings=job.embeddings,
        )
    return JobInfo(
        id=job.id, batch_id=job.batch_id, custom_id=job.custom_id,
        model=named_model or job.model,
        status=JobStatus(job.status), priority=job.priority, metadata=job.meta or {},
        created_at=aware(job.created_at), started_at=aware(job.started_at),
        finished_at=aware(job.finished_at), deadline=aware(job.deadline_at),
        attempts=job.attempts, worker_id=job.worker_id, error=job.error,
        result=result, stats=stats,
    )
