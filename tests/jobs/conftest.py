"""Fixtures on the real services: Redis on 127.0.0.1:6379 under a per-test key prefix, and
PostgreSQL (database ``test``) in a per-test schema; SQLite in a temporary file. Everything a
test creates is removed afterwards."""

from __future__ import annotations

import os
import time
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


# -- workers ---------------------------------------------------------------------------------

TINY_MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


class RunningWorker:
    """A worker running its loop in a thread of the test process."""

    def __init__(self, worker) -> None:  # type: ignore[no-untyped-def]
        import threading

        self.worker = worker
        self.rc: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.rc = self.worker.run()

    def stop(self, drain: bool = True, timeout_s: float = 30.0) -> int | None:
        self.worker.stop(drain=drain)
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "worker did not stop"
        return self.rc


def worker_settings(tiny_model: str, keys: Keys, database_url: str, **overrides):  # type: ignore[no-untyped-def]
    from worker.settings import WorkerSettings

    values = {
        "model": tiny_model, "served_model_name": TINY_MODEL_NAME, "redis_url": REDIS_URL,
        "database_url": database_url, "key_prefix": keys.prefix, "device": "cpu",
        "num_kv_blocks": 512, "max_num_seqs": 16, "waiting_buffer": 4, "lease_ttl_s": 1.5,
        "drain_timeout_s": 5.0, "reconcile_interval_s": 60.0, "reconcile_grace_s": 0.0,
        "poll_interval_ms": 10,
    }
    values.update(overrides)
    return WorkerSettings(**values)


@pytest.fixture
def start_worker(tiny_model: str, keys: Keys, pg_url: str, pg_engine: Engine):  # type: ignore[no-untyped-def]
    """Start in-thread workers on the tiny model (on the test's PostgreSQL schema unless given
    ``database_url``); all are stopped (without drain) at the end."""
    from worker.loop import Worker
    from worker.main import build_engine

    started: list[RunningWorker] = []

    def start(engine_wrapper=None, database_url=None, **overrides) -> RunningWorker:  # type: ignore[no-untyped-def]
        settings = worker_settings(tiny_model, keys, database_url or pg_url, **overrides)
        engine = build_engine(settings)
        if engine_wrapper is not None:
            engine = engine_wrapper(engine)
        sql = None if database_url else pg_engine  # else the worker connects by itself
        running = RunningWorker(Worker(settings, engine, sql_engine=sql))
        started.append(running)
        return running

    yield start
    for running in started:
        if running.thread.is_alive():
            running.stop(drain=False)


def _wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05):  # type: ignore[no-untyped-def]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


@pytest.fixture
def wait_for():  # type: ignore[no-untyped-def]
    """``wait_for(predicate, timeout_s)``: poll until ``predicate()`` is truthy; return it."""
    return _wait_for
