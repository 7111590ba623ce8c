"""What every role of the store shares: the database's clock and the guarded move of jobs to a
terminal status with their ``job_metrics`` row."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    String,
    TextClause,
    Update,
    bindparam,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeEngine

from jobs.models import Job, JobMetrics
from jobs.schemas import ACTIVE_STATUSES, JobStats, JobStatus, Outcome

ACTIVE = [s.value for s in ACTIVE_STATUSES]
EXPIRED_UNRUN = "deadline passed before the job ran"
EXPIRED_ERROR = {
    JobStatus.QUEUED.value: EXPIRED_UNRUN,
    JobStatus.RUNNING.value: "deadline passed while running (worker did not report back)",
}


def to_dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def aware(dt: datetime | None) -> datetime | None:
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


def terminalize(session: Session, outcome: Outcome, worker_id: str | None = None,
                attempts: int | None = None) -> bool:
    """Move one active job to its terminal state with its metrics row; False if it was not
    active (someone else finished it first)."""
    return bool(terminalize_many(session, [outcome], worker_id=worker_id, attempts=attempts))


def terminalize_many(session: Session, outcomes: Sequence[Outcome],
                     worker_id: str | None = None, attempts: int | None = None) -> set[str]:
    """:func:`terminalize` for many outcomes in one transaction: guarded UPDATEs (statements
    built once per column set, values bound), then their metrics rows in one INSERT. Returns
    the ids that became terminal now.

    On PostgreSQL each column set is one ``UPDATE … FROM unnest(<arrays>) … RETURNING id``: a
    round trip and a statement whatever the number of jobs, and the rows it returns are the
    jobs it ended (the status guard is re-checked on any row another transaction held). SQLite
    has no arrays: an UPDATE per job there reports whether it ended its job."""
    if session.get_bind().dialect.name == "postgresql":
        first: dict[str, Outcome] = {}
        for o in outcomes:
            first.setdefault(o.job_id, o)
        groups: dict[frozenset[str], list[tuple[str, dict[str, Any]]]] = {}
        for job_id, o in first.items():
            values = _terminal_values(o, worker_id, attempts)
            groups.setdefault(frozenset(values), []).append((job_id, values))
        ended: set[str] = set()
        for columns, rows in groups.items():
            arrays = {"ids": [job_id for job_id, _ in rows]}
            for name in columns:
                column = [values[name] for _, values in rows]
                arrays[name] = [json.dumps(v) for v in column] if _is_json(name) else column
            ended.update(session.scalars(_unnest_update(columns), arrays))
        done = {job_id: o for job_id, o in first.items() if job_id in ended}
    else:
        done = {}
        for o in outcomes:
            values = _terminal_values(o, worker_id, attempts)
            if o.job_id not in done and session.execute(
                    _terminal_update(frozenset(values)),
                    {"job_id_": o.job_id, **values}).rowcount == 1:
                done[o.job_id] = o
    if done:
        session.execute(insert(JobMetrics.__table__), [
            {"job_id": job_id, **(o.stats or JobStats()).model_dump()}
            for job_id, o in done.items()])
    return set(done)


def _terminal_values(outcome: Outcome, worker_id: str | None,
                     attempts: int | None) -> dict[str, Any]:
    values: dict[str, Any] = {
        "status": outcome.status.value,
        "finished_at": to_dt(outcome.finished_at),
        "error": sql_text(outcome.error),
    }
    if worker_id is not None:
        values["worker_id"] = worker_id
    if attempts is not None:
        values["attempts"] = attempts
    result = outcome.result
    if result is not None:
        values.update(
            text=sql_text(result.text),
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            logprobs=None if result.logprobs is None else [
                lp.model_dump(mode="json") for lp in result.logprobs],
            choices=[c.model_dump(mode="json") for c in result.choices] or None,
            embeddings=result.embeddings,
        )
    return values


@functools.cache
def _unnest_update(columns: frozenset[str]) -> TextClause:
    """PostgreSQL: end every active job named in ``:ids`` with its values, one array per
    column; returns the ids it ended."""
    table, names = Job.__table__, sorted(columns)
    arrays = ", ".join(f"CAST(:{n} AS {_array_element(table.c[c].type)}[])"
                       for n, c in [("ids", "id")] + [(n, n) for n in names])
    sets = ", ".join(f"{n} = v.{n}::json" if _is_json(n) else f"{n} = v.{n}" for n in names)
    active = ", ".join(f"'{status}'" for status in ACTIVE)
    return text(f"UPDATE {table.name} SET {sets} FROM unnest({arrays}) "
                f"AS v(id, {', '.join(names)}) WHERE {table.name}.id = v.id "
                f"AND {table.name}.status IN ({active}) RETURNING {table.name}.id")


def _array_element(column_type: TypeEngine[Any]) -> str:
    """The type a column's values travel in: text for strings (a cast to ``varchar(n)`` would
    cut a long value where the column refuses it) and JSON (cast back in the statement), the
    column's own type otherwise."""
    if isinstance(column_type, String | JSON):
        return "text"
    return column_type.compile(dialect=postgresql.dialect())


def _is_json(column: str) -> bool:
    return isinstance(Job.__table__.c[column].type, JSON)


@functools.cache
def _terminal_update(columns: frozenset[str]) -> Update:
    """``UPDATE jobs SET <columns> WHERE id = :job_id_ AND status is active``, with bound
    values: built and compiled once per column set, not per job."""
    table = Job.__table__
    return (update(table)
            # or_, not in_: an expanding IN cannot take part in an executemany
            .where(table.c.id == bindparam("job_id_"),
                   or_(*(table.c.status == status for status in ACTIVE)))
            .values({name: bindparam(name, type_=table.c[name].type)
                     for name in sorted(columns)}))


def end_many(session: Session, rows: Sequence[tuple[str, str, str]], status: JobStatus,
             now_s: float) -> list[tuple[str, str]]:
    """Move many active jobs, given as (id, status before, error), to ``status`` with a
    metrics row each, in a few statements (one per distinct error, one insert); the bulk
    counterpart of :func:`terminalize`. Returns (id, status before) of the jobs that were
    still active."""
    before = {job_id: prior for job_id, prior, _ in rows}
    by_error: dict[str, list[str]] = {}
    for job_id, _, error in rows:
        by_error.setdefault(error, []).append(job_id)
    ended: list[str] = []
    for error, ids in by_error.items():
        ended += session.scalars(
            update(Job).where(Job.id.in_(ids), Job.status.in_(ACTIVE))
            .values(status=status.value, finished_at=to_dt(now_s), error=sql_text(error))
            .returning(Job.id).execution_options(synchronize_session=False)
        ).all()
    if ended:
        empty = JobStats().model_dump()
        session.execute(insert(JobMetrics), [{"job_id": job_id, **empty} for job_id in ended])
    return sorted((job_id, before[job_id]) for job_id in ended)


def sql_text(value: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL; a model may emit it. token_ids keep the exact output.
    return value.replace("\x00", "\ufffd") if value is not None else None
