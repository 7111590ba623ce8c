"""Fixtures on the real services, shared by every test directory: Redis on 127.0.0.1:6379
under a per-test key prefix, PostgreSQL (database ``test``) in a per-test schema, SQLite in a
temporary file. Everything a test creates is removed afterwards.

Helpers that test modules import live in uniquely named modules (``services``, ...), never
in a ``conftest``: with several ``conftest.py`` files, ``import conftest`` is ambiguous."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from services import PG_URL, REDIS_URL
from sqlalchemy import Engine, text

from jobs import db
from jobs.constants import Keys


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """Whatever thread count a test sets (a bench's ``main`` with ``--threads 1``), the next
    test starts with the one before it: a leaked count would change later tests' speed, and
    their kernels' split of work, by test order."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama saved as transformers saves it (one for the whole session; the
    engine tests have their own set)."""
    from engine.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def keys(redis_client: redis.Redis) -> Iterator[Keys]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    keys = Keys(prefix=f"kvbatch-test-{uuid.uuid4().hex[:12]}")
    yield keys
    stale = list(redis_client.scan_iter(match=f"{keys.prefix}:*", count=1000))
    for start in range(0, len(stale), 1000):
        redis_client.delete(*stale[start : start + 1000])


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL schema of this test's own (empty), dropped afterwards."""
    schema = f"kvb_test_{uuid.uuid4().hex[:12]}"
    admin = db.make_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    admin = db.make_engine(PG_URL)  # a fresh pool: the test may have restarted PostgreSQL
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path) -> str:  # type: ignore[no-untyped-def]
    return f"sqlite:///{tmp_path / 'kvbatch.db'}"


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")


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
