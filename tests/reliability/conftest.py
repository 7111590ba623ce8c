"""Fixtures of the reliability suite: real Redis and PostgreSQL (a per-test key prefix and
schema), worker *processes* on a tiny model, and a Redis server of the test's own on a spare
port for restarts with data loss. ``KVBATCH_SOAK=1`` runs the full-size variants.

Tests that restart the shared PostgreSQL are marked ``pg_restart``; they rely on pytest running
tests serially (as CI does) and always leave PostgreSQL running.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the chaos harness module

from chaos import RedisServer, WorkerProcs

from jobs import db
from jobs.constants import Keys

REDIS_URL = os.environ.get("KVBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get(
    "KVBATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
SOAK = os.environ.get("KVBATCH_SOAK") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pg_restart: restarts the shared PostgreSQL server")


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[Keys]:
    keys = Keys(prefix=f"kvbatch-rel-{uuid.uuid4().hex[:12]}")
    yield keys
    stale = list(redis_client.scan_iter(match=f"{keys.prefix}:*", count=1000))
    for start in range(0, len(stale), 1000):
        redis_client.delete(*stale[start:start + 1000])


@pytest.fixture
def pg_url() -> Iterator[str]:
    schema = f"kvb_rel_{uuid.uuid4().hex[:12]}"
    admin = db.make_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    admin.dispose()
    admin = db.make_engine(PG_URL)  # a fresh pool: PostgreSQL may have restarted
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = db.make_engine(pg_url)
    db.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own on a spare port, no persistence: restart = data loss."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def workers(tiny_model: str, keys: Keys, pg_url: str, tmp_path: Path) -> Iterator[WorkerProcs]:
    """Start worker processes with ``workers.start(name, **settings)``; all are killed at the
    end. Defaults: shared Redis, the test's schema, lease 1.5 s."""
    procs = WorkerProcs(tiny_model, keys, REDIS_URL, pg_url, tmp_path / "logs")
    yield procs
    procs.kill_all()
