"""SQL holds the backlog, Redis a bounded window: ``jobs.fed_at`` marks the jobs handed to their
model's stream, a partial index orders the rest (queued, not fed) for the feeder, another finds
the fed active jobs for the reconciler. Jobs active before this revision are all in their
streams already: they count as fed.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BACKLOG = "status = 'queued' AND fed_at IS NULL"
FED = "fed_at IS NOT NULL AND status IN ('queued', 'running')"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("fed_at", sa.DateTime(timezone=True)))
    op.execute("UPDATE jobs SET fed_at = created_at WHERE status IN ('queued', 'running')")
    op.create_index("ix_jobs_backlog", "jobs", ["model", "priority", "batch_id", "id"],
                    postgresql_where=sa.text(BACKLOG), sqlite_where=sa.text(BACKLOG))
    op.create_index("ix_jobs_fed", "jobs", ["model", "id"],
                    postgresql_where=sa.text(FED), sqlite_where=sa.text(FED))


def downgrade() -> None:
    op.drop_index("ix_jobs_fed", "jobs")
    op.drop_index("ix_jobs_backlog", "jobs")
    op.drop_column("jobs", "fed_at")
