"""Process entry: check the services, build the engine, serve metrics, run the loop, stop on
SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Any

from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.llm_engine import LLMEngine
    from worker.engine_process import EngineProcess

log = logging.getLogger(__name__)

# Startup checks give up after this long, so a worker pointed at the wrong place exits within
# seconds instead of loading its model first.
STARTUP_TIMEOUT_S = 5.0


def build_engine(s: WorkerSettings) -> LLMEngine:
    """The ``engine.LLMEngine`` of the worker settings."""
    from engine.llm_engine import LLMEngine

    return LLMEngine(s.engine)


def start_engine(s: WorkerSettings) -> LLMEngine | EngineProcess:
    """The worker's engine, loaded: in a child process unless ``s.engine_process`` is off."""
    if s.engine_process:
        from worker.engine_process import EngineProcess

        return EngineProcess(s.engine)
    return build_engine(s)


def preflight(s: WorkerSettings) -> None:
    """Fail fast, before the model loads: the job limits parse, the database is at this
    code's schema revision, Redis answers, and the model is one this machine has.

    Raises:
        jobs.db.SchemaNotReady: the database is missing or not migrated to head.
        redis.RedisError, sqlalchemy.exc.SQLAlchemyError: a service cannot be reached.
        ValueError: the model is neither the default one nor a model directory.
    """
    import redis

    from engine.models.loader import resolve_model_dir
    from jobs.db import check_schema, make_engine
    from jobs.limits import JobLimits

    JobLimits()  # a bad KVBATCH_MAX_* value fails here, not after the model loads

    db = make_engine(s.database_url, connect_timeout_s=STARTUP_TIMEOUT_S)
    try:
        check_schema(db)
    finally:
        db.dispose()

    client = redis.Redis.from_url(s.redis_url, socket_timeout=STARTUP_TIMEOUT_S,
                                  socket_connect_timeout=STARTUP_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()
    resolve_model_dir(s.engine.model)


def serve_metrics(settings: WorkerSettings, registry: CollectorRegistry) -> Any:
    """Serve ``/metrics`` on ``metrics_host:metrics_port`` (127.0.0.1 unless told); returns the
    HTTP server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(settings.metrics_port or 0, addr=settings.metrics_host,
                                        registry=registry)
    return server


def run_worker(settings: WorkerSettings) -> int:
    """Run a worker in this process until SIGTERM/SIGINT (a second signal skips the drain);
    call :func:`preflight` first."""
    from worker.loop import Worker

    # A stop asked for while the model loads is taken once the worker exists (holding
    # nothing yet, it then stops at once, exit 0): under the default action the process would
    # die mid-load with status -15.
    worker: Worker | None = None
    signals = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal signals
        signals += 1
        log.info("signal %d: %s", signum, "stopping" if signals == 1 else "no drain")
        if worker is not None:
            worker.stop(drain=signals == 1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker = Worker(settings, start_engine(settings))
    if signals:
        worker.stop(drain=signals == 1)
    if settings.metrics_port is not None:
        serve_metrics(settings, worker.metrics.registry)
    return worker.run()
