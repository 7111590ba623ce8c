"""One batch lifecycle: an HTTP batch's status, times and counts are its ``batches`` row's, whose
status takes ``validating`` and ``failed`` besides ``in_progress``/``completed``/``expired``, and
``cancelled``; ``api_batches`` keeps what the API adds (owner, input, files). OpenAI's
``cancelling`` is a batch with ``cancel_requested_at`` that has not ended, ``finalizing`` an ended
one whose files (``files_at``) are not recorded yet. The row lease of ``api_batches`` goes: the
API's runner takes the lease of ``jobs.lease`` like every other component, and its writes carry
the lease's fencing token, checked against ``batches.fence``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)
STATUSES = ("validating", "failed", "in_progress", "completed", "expired", "cancelled")
OLD_STATUSES = ("in_progress", "completed", "expired")
API_STAMPS = ("in_progress", "expires", "finalizing", "completed", "failed", "expired",
              "cancelling", "cancelled")


def _api(column: str) -> str:
    return f"(SELECT a.{column} FROM api_batches a WHERE a.id = batches.id)"


def _status_check(statuses: tuple[str, ...]) -> None:
    if op.get_bind().dialect.name != "sqlite":  # see 0002: SQLite goes without the CHECK
        op.drop_constraint("ck_batches_status", "batches", type_="check")
        op.create_check_constraint("ck_batches_status", "batches",
                                   f"status IN ({', '.join(repr(s) for s in statuses)})")


def upgrade() -> None:
    op.add_column("batches", sa.Column("started_at", TZ))
    op.add_column("batches", sa.Column("cancel_requested_at", TZ))
    op.add_column("batches", sa.Column("fence", sa.BigInteger))
    op.add_column("api_batches", sa.Column("files_at", TZ))
    _status_check(STATUSES)
    # Every API batch gets its batch row (one still validating, or failed, may have none).
    op.execute("INSERT INTO batches (id, model, metadata, created_at, deadline_at, num_jobs, "
               "status, webhook_attempts) SELECT a.id, COALESCE(a.model, ''), '{}', "
               "a.created_at, a.expires_at, 0, 'in_progress', 0 FROM api_batches a "
               "WHERE NOT EXISTS (SELECT 1 FROM batches b WHERE b.id = a.id)")
    ended = ("CASE a.status WHEN 'validating' THEN 'validating' WHEN 'failed' THEN 'failed' "
             "WHEN 'completed' THEN 'completed' WHEN 'expired' THEN 'expired' "
             "WHEN 'cancelled' THEN 'cancelled' WHEN 'finalizing' THEN CASE WHEN "
             "a.cancelling_at IS NOT NULL THEN 'cancelled' ELSE batches.status END "
             "ELSE 'in_progress' END")
    op.execute(f"UPDATE batches SET started_at = {_api('in_progress_at')}, "
               f"cancel_requested_at = {_api('cancelling_at')}, "
               f"status = (SELECT {ended} FROM api_batches a WHERE a.id = batches.id), "
               f"completed_at = COALESCE(batches.completed_at, {_api('failed_at')}, "
               f"{_api('finalizing_at')}) "
               "WHERE id IN (SELECT id FROM api_batches)")
    op.execute("UPDATE api_batches SET files_at = COALESCE(completed_at, expired_at, "
               "cancelled_at, failed_at)")
    op.drop_index("ix_api_batches_status", table_name="api_batches")
    for column in ("status", "model", "total", "lease_holder", "lease_until", "created_at",
                   *(f"{stamp}_at" for stamp in API_STAMPS)):
        op.drop_column("api_batches", column)


def downgrade() -> None:
    for column in (sa.Column("status", sa.String(16)), sa.Column("model", sa.String(255)),
                   sa.Column("total", sa.Integer, nullable=False, server_default="0"),
                   sa.Column("lease_holder", sa.String(32)), sa.Column("lease_until", TZ),
                   sa.Column("created_at", TZ),
                   *(sa.Column(f"{stamp}_at", TZ) for stamp in API_STAMPS)):
        op.add_column("api_batches", column)
    op.create_index("ix_api_batches_status", "api_batches", ["status"])

    def batch(column: str) -> str:
        return f"(SELECT b.{column} FROM batches b WHERE b.id = api_batches.id)"

    status = batch("status")
    op.execute(
        "UPDATE api_batches SET "
        f"status = CASE WHEN {status} IN ('validating', 'failed', 'in_progress') THEN {status} "
        f"WHEN files_at IS NULL THEN 'finalizing' ELSE {status} END, "
        f"model = {batch('model')}, total = COALESCE({batch('num_jobs')}, 0), "
        f"created_at = {batch('created_at')}, expires_at = {batch('deadline_at')}, "
        f"in_progress_at = {batch('started_at')}, cancelling_at = "
        f"{batch('cancel_requested_at')}")
    ended_at = batch("completed_at")
    op.execute("UPDATE api_batches SET finalizing_at = CASE WHEN status IN ('finalizing', "
               f"'completed', 'expired', 'cancelled') THEN {ended_at} END, "
               f"failed_at = CASE WHEN status = 'failed' THEN {ended_at} END, "
               "completed_at = CASE WHEN status = 'completed' THEN files_at END, "
               "expired_at = CASE WHEN status = 'expired' THEN files_at END, "
               "cancelled_at = CASE WHEN status = 'cancelled' THEN files_at END")
    op.execute("UPDATE batches SET status = 'completed' "
               "WHERE status IN ('failed', 'cancelled')")
    op.execute("DELETE FROM batches WHERE status = 'validating'")
    _status_check(OLD_STATUSES)
    op.drop_column("api_batches", "files_at")
    op.drop_column("batches", "fence")
    op.drop_column("batches", "cancel_requested_at")
    op.drop_column("batches", "started_at")
