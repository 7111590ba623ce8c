"""Initial schema: batches, jobs, job_metrics and the job_stats view.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)

JOB_STATS_VIEW = """
CREATE VIEW job_stats AS
SELECT j.id AS job_id, j.batch_id, j.model, j.status,
       m.queue_wait_s, m.ttft_s, m.tpot_s, m.e2e_s,
       m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens,
       m.peak_kv_blocks, m.peak_kv_bytes, m.preemptions,
       j.worker_id, j.finished_at
FROM jobs j JOIN job_metrics m ON m.job_id = j.id
WHERE j.status IN ('succeeded', 'failed', 'cancelled', 'expired')
"""


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("deadline_at", TZ),
        sa.Column("num_jobs", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id", ondelete="CASCADE")),
        sa.Column("custom_id", sa.String(255)),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("deadline_at", TZ),
        sa.Column("started_at", TZ),
        sa.Column("finished_at", TZ),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("worker_id", sa.String(128)),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("error", sa.Text),
        sa.Column("text", sa.Text),
        sa.Column("token_ids", sa.JSON),
        sa.Column("finish_reason", sa.String(16)),
        sa.Column("logprobs", sa.JSON),
        sa.Column("choices", sa.JSON),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'expired')",
            name="ck_jobs_status",
        ),
    )
    op.create_index("ix_jobs_status_model", "jobs", ["status", "model"])
    op.create_index("ix_jobs_batch_status", "jobs", ["batch_id", "status"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.create_index("uq_jobs_batch_custom_id", "jobs", ["batch_id", "custom_id"], unique=True)
    op.create_table(
        "job_metrics",
        sa.Column(
            "job_id",
            sa.String(64),
            sa.ForeignKey("jobs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("queue_wait_s", sa.Float),
        sa.Column("ttft_s", sa.Float),
        sa.Column("tpot_s", sa.Float),
        sa.Column("e2e_s", sa.Float),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cached_prompt_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("generated_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("peak_kv_blocks", sa.Integer, nullable=False, server_default="0"),
        sa.Column("peak_kv_bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("preemptions", sa.Integer, nullable=False, server_default="0"),
    )
    op.execute(JOB_STATS_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_stats")
    op.drop_table("job_metrics")
    op.drop_index("uq_jobs_batch_custom_id", table_name="jobs")
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_index("ix_jobs_batch_status", table_name="jobs")
    op.drop_index("ix_jobs_status_model", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("batches")
