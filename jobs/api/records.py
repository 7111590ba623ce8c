"""The SQL of the API's files and batch objects. Every read and write names the owning key:
another key's object is not found, whatever its id."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine, or_, select, update
from sqlalchemy.orm import Session

from jobs.echo import clip
from jobs.models import ApiBatch, Batch, File
from jobs.schemas import BatchStatus
from jobs.store import db_now
from jobs.store.batches import ACTIVE_BATCH, fence_batch

Row = TypeVar("Row", File, ApiBatch)


def new_id(prefix: str) -> str:
    """``prefix`` + milliseconds since the epoch + 64 random bits: ids sort by creation
    time (list pages are id ranges) and cannot be guessed."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


class ApiRecords:
    """Files and batch objects, scoped to their owner."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def add(self, row: File, expires_in_s: float,
            before: Callable[[Session], None] = lambda _: None) -> File:
        """Insert ``row`` with the database's time as its ``created_at``, expiring
        ``expires_in_s`` later; ``before`` runs first in the same transaction (a quota check
        that raises)."""
        with self.session() as session, session.begin():
            before(session)
            row.created_at = db_now(session)
            row.expires_at = row.created_at + timedelta(seconds=expires_in_s)
            session.add(row)
        return row

    def expired_files(self, limit: int = 1000) -> list[File]:
        """Files past their ``expires_at`` (the database's clock), oldest first."""
        with self.session() as session:
            return list(session.scalars(
                select(File).where(File.expires_at <= db_now(session))
                .order_by(File.expires_at).limit(limit)))

    def get(self, kind: type[Row], owner: str | None, object_id: str) -> Row | None:
        """The object ``object_id`` of ``owner`` (of anyone when ``owner`` is None)."""
        query = select(kind).where(kind.id == object_id)
        if owner is not None:
            query = query.where(kind.owner_id == owner)
        with self.session() as session:
            return session.scalars(query).first()

    def page(self, kind: type[Row], owner: str, *, after: str | None, limit: int,
             newest_first: bool = True, **equal: Any) -> tuple[list[Row], bool]:
        """A page of ``owner``'s objects after the id ``after``, and whether more follow."""
        query = select(kind).where(kind.owner_id == owner)
        for column, value in equal.items():
            query = query.where(getattr(kind, column) == value)
        if after is not None:
            query = query.where(kind.id < after if newest_first else kind.id > after)
        query = query.order_by(kind.id.desc() if newest_first else kind.id).limit(limit + 1)
        with self.session() as session:
            rows = list(session.scalars(query))
        return rows[:limit], len(rows) > limit

    def delete_file(self, owner: str | None, file_id: str) -> bool:
        """Delete the row of ``owner``'s file ``file_id`` (of anyone's when ``owner`` is
        None); False if there was none."""
        query = select(File).where(File.id == file_id)
        if owner is not None:
            query = query.where(File.owner_id == owner)
        with self.session() as session, session.begin():
            row = session.scalars(query).first()
            if row is None:
                return False
            session.delete(row)
        return True

    def set_errors(self, batch_id: str, errors: dict[str, Any]) -> None:
        """Record the line errors of a batch's input file (before it fails)."""
        with self.session() as session, session.begin():
            session.execute(update(ApiBatch).where(ApiBatch.id == batch_id)
                            .values(errors=errors))

    def begin_attempt(self, batch_id: str, phase: str) -> int:
        """Count one more try at ``phase`` (``validate`` or ``finalize``) of a batch, before
        the work starts (a try that kills its process is counted too); the tries so far."""
        column = getattr(ApiBatch, f"{phase}_attempts")
        with self.session() as session, session.begin():
            return int(session.scalar(update(ApiBatch).where(ApiBatch.id == batch_id)
                                      .values({column: column + 1}).returning(column)) or 0)

    def note_error(self, batch_id: str, error: str) -> None:
        """Keep ``error`` (cut to :data:`jobs.echo.MAX_MESSAGE_CHARS`) as why the last try at a
        batch failed."""
        with self.session() as session, session.begin():
            session.execute(update(ApiBatch).where(ApiBatch.id == batch_id)
                            .values(last_error=clip(error)))

    def unfinished(self) -> list[ApiBatch]:
        """What the runner looks at each round, oldest first: batches not ended, and ended
        ones (but failed) whose files are not recorded yet."""
        with self.session() as session:
            return list(session.scalars(
                select(ApiBatch).join(ApiBatch.batch)
                .where(or_(Batch.status.in_(ACTIVE_BATCH),
                           ApiBatch.files_at.is_(None) & (Batch.status != BatchStatus.FAILED)))
                .order_by(ApiBatch.id)))

    def record_files(self, batch_id: str, files: list[File], fence: int,
                     expires_in_s: float) -> bool:
        """Insert an ended batch's output ``files`` (expiring ``expires_in_s`` from now) and
        record them on the batch in one transaction, if ``fence`` is still the batch lease's
        newest token; False (nothing changed) if not, or if its files were recorded
        already."""
        with self.session() as session, session.begin():
            if not fence_batch(session, batch_id, fence):
                return False
            now = db_now(session)
            ids = {f.kind: f.id for f in files}
            recorded = session.execute(
                update(ApiBatch).where(ApiBatch.id == batch_id, ApiBatch.files_at.is_(None))
                .values(files_at=now, output_file_id=ids.get("output"),
                        error_file_id=ids.get("error")))
            if recorded.rowcount != 1:
                return False
            for f in files:
                f.created_at, f.expires_at = now, now + timedelta(seconds=expires_in_s)
                session.add(f)
        return True
