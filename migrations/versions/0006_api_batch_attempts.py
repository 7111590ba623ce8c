"""API batches always end: ``api_batches`` counts the tries at validating a batch and at writing
its files (each counted when a process takes the batch up, before the work, so a try that kills
its process counts too) and keeps the last try's error; past the limit the batch fails (or ends
without its files) with that reason.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for name in ("validate_attempts", "finalize_attempts"):
        op.add_column("api_batches", sa.Column(name, sa.Integer, nullable=False,
                                               server_default="0"))
    op.add_column("api_batches", sa.Column("last_error", sa.Text))


def downgrade() -> None:
    for name in ("last_error", "finalize_attempts", "validate_attempts"):
        op.drop_column("api_batches", name)
