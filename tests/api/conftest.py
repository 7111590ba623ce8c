"""Fixtures of the HTTP API tests: a real ``kvbatch serve`` process on 127.0.0.1, API keys, the
official ``openai`` client, and an in-thread worker on a tiny random model; Redis and
PostgreSQL as everywhere (a per-test key prefix and schema)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from api_server import ApiServer
from services import REDIS_URL, thread_workers
from sqlalchemy import Engine

from jobs import db
from jobs.api.keys import KeyStore
from jobs.constants import Keys

MODEL = "tiny"


@pytest.fixture
def services(keys: Keys, pg_url: str) -> dict[str, str]:
    db.upgrade(pg_url)
    return {"redis_url": REDIS_URL, "database_url": pg_url, "key_prefix": keys.prefix}


@pytest.fixture
def engine(services: dict[str, str]) -> Iterator[Engine]:
    engine = db.make_engine(services["database_url"])
    yield engine
    engine.dispose()


@pytest.fixture
def make_key(engine: Engine) -> Callable[[str], str]:
    """A new API key named ``name``."""
    return lambda name: KeyStore(engine).create(name)[1]


@pytest.fixture
def start_server(services: dict[str, str],
                 tmp_path: Path) -> Iterator[Callable[..., ApiServer]]:
    servers: list[ApiServer] = []

    def start(**settings: object) -> ApiServer:
        server = ApiServer(services, tmp_path / "files", tmp_path / f"api{len(servers)}.log",
                           **settings)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server: Callable[..., ApiServer]) -> ApiServer:
    return start_server()


@pytest.fixture
def openai_client(server: ApiServer,
                  make_key: Callable[[str], str]) -> Callable[..., openai.OpenAI]:
    """``openai.OpenAI`` on the test's server with a new key (or ``api_key``)."""

    def make(api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key or make_key("team"),
                             max_retries=0, timeout=30)

    return make


@pytest.fixture
def start_worker(tiny_model: str, services: dict[str, str]) -> Iterator[Callable[..., object]]:
    """A worker loop on the tiny model in a thread; stopped (no drain) at the end."""
    yield from thread_workers(tiny_model, services, MODEL)
