"""SQL tables: ``batches``, ``jobs`` (request, status, result) and ``job_metrics`` (one row per
terminal job). The Alembic migrations in ``migrations/`` create them, and the ``job_stats`` view
over them; this module is their Python mirror and must match the latest migration.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

STATUS_VALUES = ("queued", "running", "succeeded", "failed", "cancelled", "expired")
BATCH_IN_PROGRESS, BATCH_COMPLETED, BATCH_EXPIRED = "in_progress", "completed", "expired"
BATCH_STATUS_VALUES = (BATCH_IN_PROGRESS, BATCH_COMPLETED, BATCH_EXPIRED)


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
    # Lifecycle, driven by the control plane (worker/control/): in_progress -> completed (every
    # job terminal) or expired (deadline passed), set once; then the completion event, the
    # webhook (retried with backoff) and the optional results export.
    status: Mapped[str] = mapped_column(String(16), default="in_progress",
                                        server_default="in_progress")
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
        CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'expired')",
            name="ck_jobs_status",
        ),
        Index("ix_jobs_status_model", "status", "model"),
        Index("ix_jobs_batch_status", "batch_id", "status"),
        Index("ix_jobs_created_at", "created_at"),
        Index("ix_jobs_finished_at", "finished_at"),
        Index("uq_jobs_batch_custom_id", "batch_id", "custom_id", unique=True),
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


class JobMetrics(Base):
    """Exactly one row per terminal job (the primary key is the job id)."""

    __tablename__ = "job_metrics"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    queue_wait_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    generated_tokens: Mapped[int] = mapped_column(Integer, default=0)
    peak_kv_blocks: Mapped[int] = mapped_column(Integer, default=0)
    peak_kv_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)

