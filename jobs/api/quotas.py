"""Per-key quotas: files, stored bytes, active batches and queued requests (``ApiSettings``'
``max_*_per_key``). Each check runs in the transaction that adds what it counts, after locking
the key's row, so two requests of one key never both pass on the same count. A refusal is a 400
with OpenAI's error shape, code ``quota_exceeded``, naming the limit and its setting (not a 429:
the ``openai`` client retries those, and a quota does not pass by waiting a second)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs.api.objects import ApiError
from jobs.api.settings import API_ENV_PREFIX, ApiSettings
from jobs.models import ApiBatch, ApiKey, Batch, File, Job
from jobs.schemas import ACTIVE_STATUSES, BatchStatus
from jobs.store.batches import ACTIVE_BATCH


def exceeded(what: str, setting: str, limit: int) -> ApiError:
    """The refusal of something over the key's ``setting`` (an ``ApiSettings`` field)."""
    return ApiError(400, f"quota exceeded: {what}, and a key may have at most {limit} "
                         f"({API_ENV_PREFIX}{setting.upper()})", code="quota_exceeded")


class Quotas:
    """The checks of one deployment's quotas."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings

    def check_upload(self, session: Session, owner: str, size: int) -> None:
        """Raise ``ApiError`` when a new file of ``size`` bytes puts ``owner`` over its files
        or its stored bytes."""
        _lock(session, owner)
        files, stored = session.execute(select(func.count(), func.coalesce(func.sum(
            File.bytes), 0)).where(File.owner_id == owner)).one()
        s = self.settings
        if files + 1 > s.max_files_per_key:
            raise exceeded(f"the key holds {files} files", "max_files_per_key",
                           s.max_files_per_key)
        if stored + size > s.max_stored_bytes_per_key:
            raise exceeded(f"the key's files hold {stored} bytes and this one {size}",
                           "max_stored_bytes_per_key", s.max_stored_bytes_per_key)

    def check_batch(self, session: Session, owner: str) -> None:
        """Raise ``ApiError`` when ``owner`` may not start one more batch: it has
        ``max_active_batches_per_key`` not ended (or not finalized), or its queued requests
        are at ``max_queued_rows_per_key``."""
        _lock(session, owner)
        active = session.scalar(
            select(func.count()).select_from(ApiBatch).join(Batch, Batch.id == ApiBatch.id)
            .where(ApiBatch.owner_id == owner,
                   Batch.status.in_(ACTIVE_BATCH)
                   | (ApiBatch.files_at.is_(None) & (Batch.status != BatchStatus.FAILED))))
        s = self.settings
        if (active or 0) >= s.max_active_batches_per_key:
            raise exceeded(f"the key has {active} batches that have not ended",
                           "max_active_batches_per_key", s.max_active_batches_per_key)
        self.check_rows(session, owner, 0)

    def check_rows(self, session: Session, owner: str, rows: int) -> None:
        """Raise ``ApiError`` when ``rows`` more requests put ``owner`` over its queued
        requests (or, with none, when it is at the limit already)."""
        queued = self.queued_rows(session, owner)
        limit = self.settings.max_queued_rows_per_key
        if queued + max(rows, 1) > limit:
            raise exceeded(f"the key has {queued} requests queued or running"
                           + (f" and this batch {rows}" if rows else ""),
                           "max_queued_rows_per_key", limit)

    @staticmethod
    def queued_rows(session: Session, owner: str) -> int:
        """Requests of ``owner``'s batches queued or running: its API batches' and its named
        batches' (``jobs.api.rows``), the batches whose tenant it is."""
        return int(session.scalar(
            select(func.count()).select_from(Job).join(Batch, Batch.id == Job.batch_id)
            .where(Batch.owner == owner,
                   Job.status.in_([s.value for s in ACTIVE_STATUSES]))) or 0)


def _lock(session: Session, owner: str) -> None:
    """Lock the key's row until the transaction ends (PostgreSQL; SQLite locks the database on
    the first write)."""
    session.execute(select(ApiKey.id).where(ApiKey.id == owner).with_for_update())
