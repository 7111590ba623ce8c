"""Per-key quotas and shares: ``batches.owner`` is the tenant a batch belongs to (the API key of
an HTTP batch; NULL for the SDK's and ``kvbatch submit``'s batches, one tenant together), so the
feeder shares a model's stream by tenant, then by batch; ``files.expires_at`` is when a file is
purged (OpenAI's ``expires_after`` on upload, else the deployment's retention).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("owner", sa.String(32)))
    op.execute("UPDATE batches SET owner = (SELECT a.owner_id FROM api_batches a "
               "WHERE a.id = batches.id) WHERE id IN (SELECT id FROM api_batches)")
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True)))
    op.create_index("ix_files_expires_at", "files", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_files_expires_at", "files")
    op.drop_column("files", "expires_at")
    op.drop_column("batches", "owner")
