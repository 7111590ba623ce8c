"""Fixtures for the SDK and CLI tests, on the real services: Redis on 127.0.0.1:6379 under a
per-test key prefix, PostgreSQL (database ``test``) in a per-test schema, and in-thread
workers on a tiny random model. Everything a test creates is removed afterwards."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from services import REDIS_URL, thread_workers

from jobs import db
from jobs.constants import Keys
from jobs.sdk import Client

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def key_prefix(keys: Keys) -> str:
    return keys.prefix


@pytest.fixture
def pg_url(pg_url: str) -> str:
    """The test's PostgreSQL schema (tests/conftest.py), migrated."""
    db.upgrade(pg_url)
    return pg_url


@pytest.fixture
def services(key_prefix: str, pg_url: str) -> dict[str, str]:
    """What a ``Client``, the CLI (as environment variables) and a worker need."""
    return {"redis_url": REDIS_URL, "database_url": pg_url, "key_prefix": key_prefix}


@pytest.fixture
def client(services: dict[str, str]) -> Iterator[Client]:
    with Client(model=MODEL, **services) as client:
        yield client


@pytest.fixture
def start_worker(tiny_model: str, services: dict[str, str]) -> Iterator[Callable[..., object]]:
    """Start a worker loop on the tiny model in a thread; stopped (no drain) at the end."""
    yield from thread_workers(tiny_model, services, MODEL)


@pytest.fixture
def cli_env(services: dict[str, str]) -> dict[str, str]:
    """The environment of a ``kvbatch`` subprocess talking to the test's services."""
    return {**os.environ, "KVBATCH_REDIS_URL": services["redis_url"],
            "KVBATCH_DATABASE_URL": services["database_url"],
            "KVBATCH_KEY_PREFIX": services["key_prefix"], "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def cli_args(services: dict[str, str]) -> list[str]:
    """Connection flags for an in-process ``worker.cli.main`` call."""
    return ["--redis-url", services["redis_url"], "--database-url", services["database_url"],
            "--key-prefix", services["key_prefix"]]
