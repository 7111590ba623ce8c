"""The feeder's reads and writes: the SQL backlog of a model, taken in priority and fair-share
order and marked fed (handed to the model's stream) in the same transaction."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, zip_longest
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, func, select, text, update
from sqlalchemy.orm import Session

from jobs.models import BACKLOG, Batch, Job
from jobs.schemas import JobSpec, JobStatus
from jobs.store.transitions import db_now, end_many

# Batches served per priority in one round; beyond that, a round serves the first ones in
# batch-id order after where the last round stopped (the caller's cursor).
MAX_GROUPS = 64


def parse_specs(rows: Sequence[Any]) -> tuple[list[JobSpec], dict[str, str]]:
    """``(id, spec)`` rows as jobs, and the ids today's rules refuse (stored by an older
    kvbatch) with the reason: never an exception that would stop a pass."""
    specs, invalid = [], {}
    for row in rows:
        try:
            specs.append(JobSpec.model_validate(row.spec))
        except ValueError as exc:
            invalid[row.id] = " ".join(str(exc).split())[:500]
    return specs, invalid


def _backlog(model: str) -> ColumnElement[bool]:
    """Queued jobs of ``model`` not yet fed, in the words of the partial index
    ``ix_jobs_backlog`` (literally: the planners match the index's condition by its text)."""
    return and_(Job.model == model, text(BACKLOG))


class FeedStore:
    """Takes jobs out of a model's SQL backlog. It remembers, per model, the last batch a
    round served, so that with more than :data:`MAX_GROUPS` batches the next round goes on
    from there."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._after: dict[str, str] = {}

    def has_backlog(self, model: str) -> bool:
        """Whether queued jobs of ``model`` wait in SQL, not yet fed."""
        with Session(self.engine) as session:
            return session.scalar(select(Job.id).where(_backlog(model)).limit(1)) is not None

    def backlog(self, model: str) -> int:
        """How many queued jobs of ``model`` wait in SQL, not yet fed (a count over the partial
        index ``ix_jobs_backlog``)."""
        with Session(self.engine) as session:
            return int(session.scalar(select(func.count()).select_from(Job)
                                      .where(_backlog(model))) or 0)

    def take(self, model: str, limit: int) -> tuple[list[JobSpec], list[str]]:
        """Mark up to ``limit`` backlog jobs of ``model`` fed, in one transaction, and return
        them in the order they should enter the stream, with the ids of jobs failed instead
        (stored specs today's rules refuse).

        Order: the best (lowest) priority first; within a priority, round-robin over tenants
        (``batches.owner``: an API key, or NULL for the SDK's batches and jobs without a batch,
        one tenant together), and within a tenant over its batches, oldest job first in each:
        a key with many batches gets no more of the stream than a key with one, and a small
        batch is not stuck behind a large one submitted earlier. Rows another feeder is taking
        are skipped (PostgreSQL's ``SKIP LOCKED``), and the guarded update marks each job once.
        """
        specs: list[JobSpec] = []
        failed: list[str] = []
        with Session(self.engine) as session, session.begin():
            now = db_now(session)
            while len(specs) + len(failed) < limit:
                left = limit - len(specs) - len(failed)
                priority = session.scalar(select(Job.priority).where(_backlog(model))
                                          .order_by(Job.priority).limit(1))
                if priority is None:
                    break
                groups = _groups(session, model, priority, self._after.get(model, ""))
                if not groups:
                    break
                tenants = _by_tenant(session, groups)
                share = -(-left // len(tenants))  # per tenant, then split over its batches
                ids = _interleave(
                    _interleave(_oldest(session, model, priority, g, -(-share // len(batches)))
                                for g in batches)[:share]
                    for batches in tenants)[:left]
                if not ids:  # all locked by another feeder
                    break
                self._after[model] = groups[-1] or ""
                rows = session.execute(
                    update(Job).where(Job.id.in_(ids), Job.status == JobStatus.QUEUED.value,
                                      Job.fed_at.is_(None))
                    .values(fed_at=now).returning(Job.id, Job.spec)
                    .execution_options(synchronize_session=False)).all()
                order = {job_id: i for i, job_id in enumerate(ids)}
                good, invalid = parse_specs(sorted(rows, key=lambda r: order[r.id]))
                specs += good
                failed += [job_id for job_id, _ in end_many(
                    session, [(job_id, JobStatus.QUEUED.value,
                               f"stored job no longer valid: {why}")
                              for job_id, why in invalid.items()],
                    JobStatus.FAILED, now.timestamp())]
        return specs, failed


def _interleave(lists: Iterable[list[str]]) -> list[str]:
    """Round-robin over ``lists``: the first of each, then the second of each, ..."""
    return [i for i in chain.from_iterable(zip_longest(*lists)) if i is not None]


def _by_tenant(session: Session, groups: list[str | None]) -> list[list[str | None]]:
    """``groups`` (batch ids, None for jobs without a batch) by tenant (``batches.owner``; the
    SDK's, NULL, takes jobs without a batch too), in order of each tenant's first group."""
    owners = dict(session.execute(select(Batch.id, Batch.owner).where(
        Batch.id.in_([g for g in groups if g is not None]))).all())
    tenants: dict[str | None, list[str | None]] = {}
    for group in groups:
        tenants.setdefault(owners.get(group) if group is not None else None, []).append(group)
    return list(tenants.values())


def _groups(session: Session, model: str, priority: int, after: str) -> list[str | None]:
    """The groups with backlog at ``priority``: None (jobs without a batch) first if any,
    then up to :data:`MAX_GROUPS` batch ids from the first after ``after`` on, wrapping
    around; one index seek each (a loose index scan), whatever the batches' sizes."""
    at = _backlog(model) & (Job.priority == priority)
    groups: list[str | None] = []
    if session.scalar(select(Job.id).where(at, Job.batch_id.is_(None)).limit(1)) is not None:
        groups.append(None)
    for start, stop in ((after, None), ("", after)):
        cursor = start
        while len(groups) < MAX_GROUPS:
            batch_id = session.scalar(select(Job.batch_id).where(at, Job.batch_id > cursor)
                                      .order_by(Job.batch_id).limit(1))
            if batch_id is None or (stop is not None and batch_id > stop):
                break
            groups.append(batch_id)
            cursor = batch_id
        if not after:
            break
    return groups


def _oldest(session: Session, model: str, priority: int, batch_id: str | None,
            limit: int) -> list[str]:
    """The ids of up to ``limit`` backlog jobs of one group, oldest first (ids are
    time-ordered)."""
    if limit <= 0:
        return []
    group = Job.batch_id.is_(None) if batch_id is None else Job.batch_id == batch_id
    return list(session.scalars(
        select(Job.id).where(_backlog(model), Job.priority == priority, group)
        .order_by(Job.id).limit(limit).with_for_update(skip_locked=True)))
