"""Fixtures of the reliability suite: real Redis and PostgreSQL (a per-test key prefix and
schema), worker *processes* on a tiny model, and a Redis server of the test's own on a spare
port for restarts with data loss. ``KVBATCH_SOAK=1`` runs the full-size variants.

Tests that restart the shared PostgreSQL are marked ``pg_restart``; they rely on pytest running
tests serially (as CI does) and always leave PostgreSQL running.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the chaos harness module

from chaos import RedisServer, WorkerProcs
from services import REDIS_URL

from jobs.constants import Keys


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
