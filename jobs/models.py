"""SQL tables: ``batches``, ``jobs`` (request, status, result) and ``job_metrics`` (one row per
terminal job), and the HTTP API's ``api_keys``, ``files`` and ``api_batches``. The Alembic
migrations in ``migrations/`` create them, and the ``job_stats`` view over them; this module is
their Python mirror and must match the latest migration (a test compares them). The status
checks derive from ``JobStatus``/``BatchStatus`` and the ``job_metrics`` columns from
``JobStats``: the contract is declared once, in ``jobs.schemas``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from jobs.schemas import BatchStatus, JobStats, JobStatus, is_bytes


def status_check(column: str, statuses: type[JobStatus] | type[BatchStatus]) -> str:
    """The SQL CHECK that ``column`` holds one of ``statuses``."""
    return f"{column} IN ({', '.join(repr(s.value) for s in statuses)})"


# The partial indexes' conditions (migration 0004 declares the same).
BACKLOG = "status = 'queued' AND fed_at IS NULL"
FED = "fed_at IS NOT NULL AND status IN ('queued', 'running')"


class Base(DeclarativeBase):
    pass


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_status", "status"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(255))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    num_jobs: Mapped[int] = mapped_column(Integer, default=0)
    # The one lifecycle (``BatchStatus``): validating (HTTP batches) -> in_progress -> completed
    # | expired | cancelled, or failed; moved only by ``jobs.store.BatchStore``. Then its
    # finalization: the completion event, the webhook (retried with backoff), the exports.
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.IN_PROGRESS.value,
                                        server_default=BatchStatus.IN_PROGRESS.value)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The tenant: the API key of an HTTP batch, NULL for the SDK's (one tenant together); the
    # feeder shares a model's stream by tenant, then by batch.
    owner: Mapped[str | None] = mapped_column(String(32))
    # The fencing token (``jobs.lease``) of the last holder of the batch's lease that wrote it.
    fence: Mapped[int | None] = mapped_column(BigInteger)
    # When it ended (whatever the status it ended in).
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    webhook_url: Mapped[str | None] = mapped_column(Text)
    webhook_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    webhook_next_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    webhook_error: Mapped[str | None] = mapped_column(Text)
    results_path: Mapped[str | None] = mapped_column(Text)
    notified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(status_check("status", JobStatus), name="ck_jobs_status"),
        Index("ix_jobs_status_model", "status", "model"),
        Index("ix_jobs_batch_status", "batch_id", "status"),
        Index("ix_jobs_created_at", "created_at"),
        Index("ix_jobs_finished_at", "finished_at"),
        Index("uq_jobs_batch_custom_id", "batch_id", "custom_id", unique=True),
        # The backlog in the feeder's order, and the fed active jobs (jobs.feed).
        Index("ix_jobs_backlog", "model", "priority", "batch_id", "id",
              postgresql_where=text(BACKLOG), sqlite_where=text(BACKLOG)),
        Index("ix_jobs_fed", "model", "id", postgresql_where=text(FED), sqlite_where=text(FED)),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    batch_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("batches.id", ondelete="CASCADE")
    )
    custom_id: Mapped[str | None] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # The full JobSpec JSON as submitted: what the reconciler re-enqueues.
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # When the job was handed to its model's stream (the bounded window); NULL while it waits
    # in the SQL backlog.
    fed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Deliveries to a worker, counted here so they survive crashes and Redis restarts.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(128))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    text: Mapped[str | None] = mapped_column(Text)
    token_ids: Mapped[list[int] | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    logprobs: Mapped[Any] = mapped_column(JSON)
    choices: Mapped[Any] = mapped_column(JSON)
    embeddings: Mapped[Any] = mapped_column(JSON)  # an embedding job's vectors


def _stats_columns() -> list[Column[Any]]:
    """One column per ``JobStats`` field: durations are nullable floats, counts integers that
    default to 0 (64-bit for byte counts)."""
    columns: list[Column[Any]] = []
    for name, field in JobStats.model_fields.items():
        if field.annotation is int:
            kind = BigInteger if is_bytes(name) else Integer
            columns.append(Column(name, kind, nullable=False, default=0, server_default="0"))
        else:
            columns.append(Column(name, Float))
    return columns


job_metrics = Table(
    "job_metrics", Base.metadata,
    Column("job_id", String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    *_stats_columns(),
)


class JobMetrics(Base):
    """Exactly one row per terminal job (the primary key is the job id); its columns are
    ``JobStats``' fields."""

    __table__ = job_metrics


class ApiKey(Base):
    """A key of the HTTP API: its id is public (the key starts with it), only the SHA-256 of
    its secret is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class File(Base):
    """A file of the HTTP API: an upload, or the output or error file of a batch (written from
    the jobs table when the batch ends); the content is in the API's file storage."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_owner_id", "owner_id", "id"),
                      Index("ix_files_expires_at", "expires_at"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("api_keys.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    batch_id: Mapped[str | None] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))  # upload | output | error
    # When the retention purges it (``expires_after`` on upload, else the deployment's).
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ApiBatch(Base):
    """What the HTTP API adds to a batch (``batches``, same id): its owner and its files. The
    status, times and counts are the batch's own (``batch``)."""

    __tablename__ = "api_batches"
    __table_args__ = (Index("ix_api_batches_owner_id", "owner_id", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("api_keys.id", ondelete="CASCADE"))
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[Any] = mapped_column(JSON)  # the input file's bad lines (failed)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    # When its output and error files were recorded: until then an ended batch is finalizing.
    files_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Tries at validating it and at writing its files, each counted before the work (a try
    # that kills its process counts), and the last one's error: past the limit it ends.
    validate_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    finalize_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    batch: Mapped[Batch] = relationship(primaryjoin="foreign(ApiBatch.id) == Batch.id",
                                        lazy="joined", innerjoin=True, viewonly=True)
