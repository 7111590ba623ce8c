"""Fixtures on the real services (as tests/jobs/conftest.py): Redis on 127.0.0.1:6379 under a
per-test key prefix, PostgreSQL (database ``test``) in a per-test schema, SQLite in a
temporary file. Everything a test creates is removed afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine, text

from jobs import db
from jobs.constants import Keys

REDIS_URL = os.environ.get("KVBATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_URL = os.environ.get(
    "KVBATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[Keys]:
    keys = Keys(prefix=f"kvbatch-test-{uuid.uuid4().hex[:12]}")
    yield keys
    stale = list(redis_client.scan_iter(match=f"{keys.prefix}:*", count=1000))
    if stale:
        redis_client.delete(*stale)


@pytest.fixture
def pg_url() -> Iterator[str]:
    schema = f"kvb_test_{uuid.uuid4().hex[:12]}"
    admin = db.make_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path) -> str:  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kvbatch.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def sql_engine(database_url: str) -> Iterator[Engine]:
    """A migrated database (PostgreSQL and SQLite)."""
    engine = db.make_engine(database_url)
    db.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    """A migrated PostgreSQL schema, for tests that need one database only."""
    engine = db.make_engine(pg_url)
    db.upgrade(engine)
    yield engine
    engine.dispose()
