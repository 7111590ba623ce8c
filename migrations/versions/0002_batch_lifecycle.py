"""Batch lifecycle for the control plane: status, completion time, webhook and export state.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def _columns() -> list[sa.Column]:
    return [
        # in_progress -> completed (every job terminal) | expired (deadline passed); set once.
        sa.Column("status", sa.String(16), nullable=False, server_default="in_progress"),
        sa.Column("completed_at", TZ),
        sa.Column("webhook_url", sa.Text),
        sa.Column("webhook_attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("webhook_next_at", TZ),
        sa.Column("webhook_error", sa.Text),
        sa.Column("results_path", sa.Text),
        # Completion event published and webhook settled (delivered or given up).
        sa.Column("notified_at", TZ),
    ]


def upgrade() -> None:
    # Plain ADD COLUMN, no table rebuild: rebuilding `batches` on SQLite would drop it, and with
    # foreign keys on, that cascades to every job. SQLite therefore goes without the CHECK.
    for column in _columns():
        op.add_column("batches", column)
    op.create_index("ix_batches_status", "batches", ["status"])
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(
            "ck_batches_status", "batches", "status IN ('in_progress', 'completed', 'expired')"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("ck_batches_status", "batches", type_="check")
    op.drop_index("ix_batches_status", table_name="batches")
    for column in reversed(_columns()):
        op.drop_column("batches", column.name)
