"""The SQL of the API's files and batch objects. Every read and write names the owning key:
another key's object is not found, whatever its id."""

from __future__ import annotations

import secrets
import time
from collections.abc import Collection
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine, or_, select, update
from sqlalchemy.orm import Session

from jobs.models import ApiBatch, File
from jobs.store import db_now

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

    def add(self, row: Row) -> Row:
        """Insert ``row`` with the database's time as its ``created_at``."""
        with self.session() as session, session.begin():
            row.created_at = db_now(session)
            session.add(row)
        return row

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

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self.session() as session, session.begin():
            row = session.scalars(select(File).where(File.id == file_id,
                                                     File.owner_id == owner)).first()
            if row is None:
                return False
            session.delete(row)
        return True

    def move(self, batch_id: str, before: Collection[str], after: str, *,
             keep_lease: bool = False, **values: Any) -> ApiBatch | None:
        """Move batch ``batch_id`` from one of ``before`` to ``after``, stamping
        ``<after>_at`` and setting ``values``; the batch, or None if it was not in ``before``
        (someone else moved it first). The lease ends, unless ``keep_lease``."""
        with self.session() as session, session.begin():
            stamp = {f"{after}_at": db_now(session)} if hasattr(ApiBatch, f"{after}_at") else {}
            lease = {} if keep_lease else {"lease_holder": None, "lease_until": None}
            moved = session.scalars(
                update(ApiBatch).where(ApiBatch.id == batch_id, ApiBatch.status.in_(before))
                .values(status=after, **lease, **stamp, **values)
                .returning(ApiBatch)).first()
        return moved

    def claim(self, batch_id: str, status: str, holder: str, lease_s: float) -> bool:
        """Take batch ``batch_id`` (in ``status``) for ``holder`` for ``lease_s``, unless
        another holder's lease is live."""
        with self.session() as session, session.begin():
            now = db_now(session)
            claimed = session.execute(
                update(ApiBatch).where(
                    ApiBatch.id == batch_id, ApiBatch.status == status,
                    or_(ApiBatch.lease_until.is_(None), ApiBatch.lease_until < now,
                        ApiBatch.lease_holder == holder))
                .values(lease_holder=holder, lease_until=now + timedelta(seconds=lease_s)))
        return bool(claimed.rowcount)

    def renew(self, batch_id: str, status: str, holder: str, lease_s: float) -> bool:
        """Extend ``holder``'s lease on ``batch_id``; False once the batch left ``status`` or
        the lease went to another holder."""
        with self.session() as session, session.begin():
            now = db_now(session)
            renewed = session.execute(
                update(ApiBatch).where(ApiBatch.id == batch_id, ApiBatch.status == status,
                                       ApiBatch.lease_holder == holder)
                .values(lease_until=now + timedelta(seconds=lease_s)))
        return bool(renewed.rowcount)

    def release(self, batch_id: str, holder: str) -> None:
        """End ``holder``'s lease on ``batch_id``, whatever its status."""
        with self.session() as session, session.begin():
            session.execute(update(ApiBatch).where(ApiBatch.id == batch_id,
                                                   ApiBatch.lease_holder == holder)
                            .values(lease_holder=None, lease_until=None))

    def unfinished(self, statuses: Collection[str]) -> list[ApiBatch]:
        """Batches in ``statuses`` (what the runner looks at each round), oldest first."""
        with self.session() as session:
            return list(session.scalars(select(ApiBatch).where(ApiBatch.status.in_(statuses))
                                        .order_by(ApiBatch.id)))

    def finalize(self, batch_id: str, status: str, files: list[File]) -> ApiBatch | None:
        """Insert a finalizing batch's output ``files`` and move it to ``status`` in one
        transaction; None (nothing changed) if it is no longer finalizing."""
        with self.session() as session, session.begin():
            now = db_now(session)
            ids = {f.kind: f.id for f in files}
            moved = session.scalars(
                update(ApiBatch).where(ApiBatch.id == batch_id, ApiBatch.status == "finalizing")
                .values(status=status, lease_holder=None, lease_until=None,
                        output_file_id=ids.get("output"),
                        error_file_id=ids.get("error"), **{f"{status}_at": now})
                .returning(ApiBatch)).first()
            if moved is None:
                return None
            for f in files:
                f.created_at = now
                session.add(f)
        return moved
