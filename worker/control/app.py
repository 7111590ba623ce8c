"""The Celery app of the control plane and its beat schedule.

Redis is the broker (the workers' Redis unless ``broker_url`` says otherwise; every broker key
under ``<prefix>:celery:``); messages are JSON only, never pickle. Tasks are acknowledged after
they finish (``task_acks_late``). ``task_reject_on_worker_lost`` is set too, but only matters
for process pools: ``kvbatch control`` runs a thread pool, so a run lost with its process stays
unacknowledged in Redis until the transport's visibility timeout (an hour) redelivers it. Nothing
waits for that: beat schedules every task again within its interval, and each is idempotent.

The beat scheduler keeps its state in memory (the default one persists it with pickle in a
shelve file), so it would first run each task one interval after start; :func:`run_control`
therefore sends every scheduled task once when the worker is ready, so that a control plane
restarted more often than the purge interval still purges.

``celery --app worker.control.app inspect ping`` reaches a running control worker (its settings
come from the same ``KVBATCH_*`` variables).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, signals

from worker.control import ops
from worker.control.settings import ControlSettings

QUEUE = "control"
TASK_PREFIX = "kvbatch.control."


class _LazyServices:
    """Connects on first use, in the process (and after the fork) that runs the tasks."""

    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self._services: ops.Services | None = None
        self._lock = threading.Lock()

    def get(self) -> ops.Services:
        with self._lock:
            if self._services is None:
                self._services = ops.Services.connect(self.settings)
            return self._services

    def close(self) -> None:
        with self._lock:
            if self._services is not None:
                self._services.close()
                self._services = None


def make_app(settings: ControlSettings | None = None) -> Celery:
    """A control-plane Celery app for ``settings`` (default: from the environment)."""
    settings = settings or ControlSettings()
    app = Celery("kvbatch-control", broker=settings.broker, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_default_queue=QUEUE,
        broker_transport_options={"global_keyprefix": f"{settings.key_prefix}:celery:"},
        broker_connection_retry_on_startup=True,
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule=_beat_schedule(settings),
        timezone="UTC",
        enable_utc=True,
        worker_hijack_root_logger=False,
    )
    services = _LazyServices(settings)
    app.kvbatch_services = services  # type: ignore[attr-defined]
    _register_tasks(app, services)
    return app


def _beat_schedule(s: ControlSettings) -> dict[str, dict[str, Any]]:
    every = {
        "expire_deadlines": s.expire_interval_s,
        "finalize_batches": s.finalize_interval_s,
        "reap_jobs": s.reap_interval_s,
        "purge_results": s.purge_interval_s,
    }
    # A run that waited in the queue past the next one is dropped, not piled up.
    return {name: {"task": TASK_PREFIX + name, "schedule": interval_s,
                   "options": {"expires": interval_s}}
            for name, interval_s in every.items()}


def _register_tasks(app: Celery, services: _LazyServices) -> None:
    def exclusive(name: str, fn: Callable[[ops.Services], Any]) -> Any:
        # One run at a time across replicas; a run that finds the lock taken has nothing to do.
        svc = services.get()
        with svc.lease(name).kept() as mine:
            return fn(svc) if mine else {"skipped": "another run holds the lock"}

    @app.task(name=TASK_PREFIX + "expire_deadlines", shared=False)
    def expire_deadlines() -> Any:
        return exclusive("expire", lambda svc: ops.expire_deadlines(svc, time.time()))

    @app.task(name=TASK_PREFIX + "finalize_batch", shared=False)
    def finalize_batch(batch_id: str) -> str:
        # finalize_batches lists the batch again every interval until it is finalized; the
        # lock (renewed however long the export or the POST takes) lets one run through.
        svc = services.get()
        with svc.lease(f"batch:{batch_id}").kept() as mine:
            return ops.finalize_batch(svc, batch_id, time.time()) if mine else "skipped"

    @app.task(name=TASK_PREFIX + "finalize_batches", shared=False)
    def finalize_batches() -> Any:
        due = exclusive("complete", lambda svc: ops.complete_batches(svc, time.time()))
        if isinstance(due, dict):
            return due
        for batch_id in due:
            finalize_batch.delay(batch_id)
        return due

    @app.task(name=TASK_PREFIX + "purge_results", shared=False)
    def purge_results() -> Any:
        return exclusive("purge", lambda svc: ops.purge(svc, time.time()))

    @app.task(name=TASK_PREFIX + "reap_jobs", shared=False)
    def reap_jobs() -> Any:
        return exclusive("reap", lambda svc: ops.reap(svc, time.time()))


def run_scheduled_once(app: Celery) -> list[str]:
    """Send every task of the beat schedule once, now (what beat does one interval later)."""
    names = [entry["task"] for entry in app.conf.beat_schedule.values()]
    for name in names:
        app.tasks[name].delay()
    return names


def run_control(settings: ControlSettings, concurrency: int = 4, beat: bool = True,
                loglevel: str = "INFO") -> int:
    """Run a control worker (thread pool) with the beat scheduler embedded, until stopped;
    with beat, every scheduled task also runs once as soon as the worker is ready."""
    from celery.utils.nodenames import host_format

    app = make_app(settings)
    if beat:
        def at_start(sender: Any = None, **_: Any) -> None:
            if getattr(sender, "app", None) is app:
                run_scheduled_once(app)

        signals.worker_ready.connect(at_start, weak=False)
    worker = app.Worker(pool="threads", concurrency=concurrency, beat=beat, loglevel=loglevel,
                        hostname=host_format("control@%h"), queues=[QUEUE])
    worker.start()
    return int(worker.exitcode or 0)


app = make_app()
