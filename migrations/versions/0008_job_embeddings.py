"""Embedding jobs: ``jobs.embeddings`` holds an embedding job's vectors (JSON: lists of floats,
or base64 strings of little-endian float32), one per input in order.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("embeddings", sa.JSON()))


def downgrade() -> None:
    op.drop_column("jobs", "embeddings")
