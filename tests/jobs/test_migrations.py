from __future__ import annotations

import sqlalchemy as sa
from alembic.script import ScriptDirectory

from jobs import db
from jobs.models import Base

HEAD = ScriptDirectory(str(db.migrations_dir())).get_current_head()

VIEW_COLUMNS = [
    "job_id", "batch_id", "model", "status", "queue_wait_s", "ttft_s", "tpot_s", "e2e_s",
    "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "peak_kv_blocks",
    "peak_kv_bytes", "preemptions", "gpu_s", "worker_id", "finished_at",
]


def test_upgrade_empty_database_then_downgrade_cleanly(database_url: str) -> None:
    engine = db.make_engine(database_url)
    assert db.current_revision(engine) is None
    db.upgrade(engine)
    insp = sa.inspect(engine)
    assert set(insp.get_table_names()) == {"alembic_version", "batches", "jobs", "job_metrics",
                                           "api_keys", "files", "api_batches"}
    assert insp.get_view_names() == ["job_stats"]
    assert [c["name"] for c in insp.get_columns("job_stats")] == VIEW_COLUMNS
    assert db.current_revision(engine) == HEAD

    db.upgrade(engine)  # idempotent at head
    db.downgrade(engine, "base")
    insp = sa.inspect(engine)
    assert set(insp.get_table_names()) == {"alembic_version"}
    assert insp.get_view_names() == []
    assert db.current_revision(engine) is None

    db.upgrade(engine)  # and back up again on the downgraded database
    assert db.current_revision(engine) == HEAD
    engine.dispose()


def test_models_match_migrations(sql_engine: sa.Engine) -> None:
    insp = sa.inspect(sql_engine)
    for table in Base.metadata.sorted_tables:
        migrated = {c["name"] for c in insp.get_columns(table.name)}
        assert migrated == {c.name for c in table.columns}, table.name
    indexes = {i["name"] for i in insp.get_indexes("jobs")}
    assert {"ix_jobs_status_model", "ix_jobs_batch_status", "ix_jobs_finished_at",
            "ix_jobs_backlog", "ix_jobs_fed"} <= indexes


def test_migrations_dir_is_found() -> None:
    assert (db.migrations_dir() / "env.py").is_file()
    assert list((db.migrations_dir() / "versions").glob("0001_*.py"))
