"""Queue and worker test fixtures: a tiny model and in-thread workers (the service fixtures
are in tests/conftest.py)."""

from __future__ import annotations

import pytest
from services import wait_until
from sqlalchemy import Engine
from worker_harness import RunningWorker, worker_settings

from jobs.constants import Keys

# -- workers ---------------------------------------------------------------------------------

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
        running = RunningWorker(Worker(settings, engine, db=sql))
        started.append(running)
        return running

    yield start
    for running in started:
        if running.thread.is_alive():
            running.stop(drain=False)


def _wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    return wait_until(predicate, timeout_s, interval_s)


@pytest.fixture
def wait_for():  # type: ignore[no-untyped-def]
    """``wait_for(predicate, timeout_s)``: poll until ``predicate()`` is truthy; return it."""
    return _wait_for
