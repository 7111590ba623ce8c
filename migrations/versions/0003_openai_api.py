"""The HTTP API's objects: API keys (hashed), files (uploads and batch outputs) and OpenAI batch
objects, each owned by the key that created it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def _owner() -> sa.Column:
    return sa.Column("owner_id", sa.String(32), sa.ForeignKey("api_keys.id", ondelete="CASCADE"),
                     nullable=False)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("revoked_at", TZ),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        _owner(),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("batch_id", sa.String(64)),
        sa.Column("kind", sa.String(16), nullable=False),
    )
    op.create_index("ix_files_owner_id", "files", ["owner_id", "id"])
    op.create_table(
        "api_batches",
        sa.Column("id", sa.String(64), primary_key=True),
        _owner(),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("model", sa.String(255)),
        sa.Column("metadata", sa.JSON),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("errors", sa.JSON),
        sa.Column("total", sa.Integer, nullable=False, server_default="0"),
        sa.Column("output_file_id", sa.String(64)),
        sa.Column("error_file_id", sa.String(64)),
        # Held by the API process validating or finalizing the batch (another waits it out).
        sa.Column("lease_holder", sa.String(32)),
        sa.Column("lease_until", TZ),
        sa.Column("created_at", TZ, nullable=False),
        *(sa.Column(f"{stamp}_at", TZ) for stamp in (
            "in_progress", "expires", "finalizing", "completed", "failed",
            "expired", "cancelling", "cancelled")),
    )
    op.create_index("ix_api_batches_owner_id", "api_batches", ["owner_id", "id"])
    op.create_index("ix_api_batches_status", "api_batches", ["status"])


def downgrade() -> None:
    op.drop_index("ix_api_batches_status", table_name="api_batches")
    op.drop_index("ix_api_batches_owner_id", table_name="api_batches")
    op.drop_table("api_batches")
    op.drop_index("ix_files_owner_id", table_name="files")
    op.drop_table("files")
    op.drop_table("api_keys")
