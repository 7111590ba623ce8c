"""A job's cost in GPU-seconds: ``job_metrics.gpu_s``, its share of the engine steps it ran in
(each step's time split equally among the jobs in it), and the ``job_stats`` view with it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def _view(gpu_s: bool) -> str:
    """The ``job_stats`` view of 0001, with ``gpu_s`` after ``preemptions`` when asked."""
    return f"""
CREATE VIEW job_stats AS
SELECT j.id AS job_id, j.batch_id, j.model, j.status,
       m.queue_wait_s, m.ttft_s, m.tpot_s, m.e2e_s,
       m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens,
       m.peak_kv_blocks, m.peak_kv_bytes, m.preemptions,{" m.gpu_s," if gpu_s else ""}
       j.worker_id, j.finished_at
FROM jobs j JOIN job_metrics m ON m.job_id = j.id
WHERE j.status IN ('succeeded', 'failed', 'cancelled', 'expired')
"""


def upgrade() -> None:
    op.add_column("job_metrics", sa.Column("gpu_s", sa.Float))
    op.execute("DROP VIEW job_stats")  # a column in the middle: PostgreSQL cannot replace it
    op.execute(_view(gpu_s=True))


def downgrade() -> None:
    op.execute("DROP VIEW job_stats")
    op.execute(_view(gpu_s=False))
    op.drop_column("job_metrics", "gpu_s")
