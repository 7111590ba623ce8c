"""Startup that fails fast: a command that cannot do its job says so in one line naming the fix
and exits non-zero, before loading a model; ``--debug`` shows the traceback; no command
creates files it was not asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from services import REDIS_URL

from jobs import db
from jobs.constants import Keys

REPO = Path(__file__).resolve().parents[2]


def kvbatch(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATCH_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_worker_refuses_a_database_that_is_not_at_head(tmp_path: Path, pg_url: str) -> None:
    missing = tmp_path / "none.db"
    line = one_line(kvbatch(["worker", "--model", "no-such-model", "--redis-url", REDIS_URL,
                             "--database-url", f"sqlite:///{missing}"], tmp_path))
    assert line.startswith("kvbatch worker: database") and "does not exist" in line
    assert "kvbatch db upgrade (with --database-url or KVBATCH_DATABASE_URL" in line
    assert not missing.exists() and list(tmp_path.iterdir()) == []

    # An empty PostgreSQL schema: reachable, not migrated.
    line = one_line(kvbatch(["worker", "--redis-url", REDIS_URL, "--database-url", pg_url],
                            tmp_path))
    assert "is not migrated" in line and "kvbatch db upgrade" in line
    assert f"needs {db.head_revision()}" in line

    db.upgrade(pg_url, "0001")  # one migration behind
    line = one_line(kvbatch(["worker", "--redis-url", REDIS_URL, "--database-url", pg_url],
                            tmp_path))
    assert "is at revision 0001" in line and "kvbatch db upgrade" in line


def test_an_unreachable_database_or_redis_is_one_line(tmp_path: Path, pg_url: str) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    nowhere = "postgresql://kv:s3cret@127.0.0.1:1/kv"  # nothing listens on port 1
    for args in (["worker", "--redis-url", REDIS_URL], ["submit", str(data), "-o", "out.jsonl"],
                 ["stats"]):
        line = one_line(kvbatch([*args, "--database-url", nowhere], tmp_path))
        assert "database error" in line and "s3cret" not in line, line
    # An empty PostgreSQL schema: reachable, not migrated.
    proc = kvbatch(["submit", str(data), "-o", "out.jsonl", "--redis-url", REDIS_URL,
                    "--database-url", pg_url, "--no-progress"], tmp_path)
    assert "is not migrated" in proc.stderr and proc.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_submit_refuses_an_unmigrated_database_and_creates_nothing(tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    proc = kvbatch(["submit", str(data), "-o", "out.jsonl", "--redis-url", REDIS_URL,
                    "--no-progress"], tmp_path)  # the default database: ./kvbatch.db
    assert "kvbatch submit: database kvbatch.db does not exist; run: kvbatch db upgrade" in \
        proc.stderr and proc.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no db, no output
    assert kvbatch(["db", "current"], tmp_path).stdout.startswith("base (no database")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.fixture
def migrated_sqlite(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    db.upgrade(url)
    return url


def test_unknown_model_and_unreachable_redis_are_one_line(tmp_path: Path,
                                                          migrated_sqlite: str) -> None:
    line = one_line(kvbatch(["worker", "--model", "no-such-model", "--redis-url", REDIS_URL,
                             "--database-url", migrated_sqlite], tmp_path))
    assert line.startswith("kvbatch worker: model 'no-such-model' is neither"), line

    line = one_line(kvbatch(["worker", "--redis-url", "redis://127.0.0.1:1/0",
                             "--database-url", migrated_sqlite], tmp_path))
    assert line.startswith("kvbatch worker: cannot reach Redis"), line

    line = one_line(kvbatch(["worker", "--dtype", "float8", "--database-url", migrated_sqlite],
                            tmp_path))
    assert "dtype must be one of" in line

    debug = kvbatch(["worker", "--model", "no-such-model", "--redis-url", REDIS_URL,
                     "--database-url", migrated_sqlite, "--debug"], tmp_path)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_the_sdk_does_not_create_a_database_either(tmp_path: Path) -> None:
    from jobs.db import SchemaNotReady
    from jobs.sdk import Client

    missing = tmp_path / "typo.db"
    with pytest.raises(SchemaNotReady, match=r"typo\.db does not exist; run: kvbatch db upgrade"):
        Client(REDIS_URL, f"sqlite:///{missing}")
    assert list(tmp_path.iterdir()) == []


def test_a_worker_serves_only_a_model_of_the_deployment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """KVBATCH_MODELS, which ``kvbatch serve`` reads too, bounds what a worker may serve."""
    from worker.settings import worker_settings

    monkeypatch.setenv("KVBATCH_MODELS", '["tiny", "other"]')
    assert worker_settings(served_model_name="other").model_name == "other"
    with pytest.raises(ValueError, match="KVBATCH_MODELS: tiny, other"):
        worker_settings(served_model_name="elsewhere")
    monkeypatch.delenv("KVBATCH_MODELS")
    assert worker_settings(served_model_name="elsewhere").model_name == "elsewhere"


def test_worker_id_longer_than_the_column_is_refused(tiny_model: str, keys: Keys) -> None:
    from worker_harness import worker_settings

    with pytest.raises(ValidationError, match="128"):
        worker_settings(tiny_model, keys, "sqlite://", worker_id="w" * 129)
