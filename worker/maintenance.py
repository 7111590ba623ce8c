"""The reconciler, run from its own thread so that a long pass (a large backlog to compare
against the stream) never delays the worker loop or its lease."""

from __future__ import annotations

import logging
import threading

import redis
from sqlalchemy.exc import SQLAlchemyError

from jobs.queue import JobQueue
from jobs.reconcile import reconcile
from jobs.schemas import JobStatus
from jobs.store import MaintenanceStore
from worker.metrics import WorkerMetrics
from worker.retry import short_error

log = logging.getLogger(__name__)


class ReconcilerThread:
    """Every ``interval_s`` (and once at start), if no other worker of the model holds the
    reconcile lock, run :func:`jobs.reconcile.reconcile`."""

    def __init__(self, store: MaintenanceStore, queue: JobQueue, worker_id: str, interval_s: float,
                 grace_s: float, metrics: WorkerMetrics) -> None:
        self.store, self.queue, self.worker_id = store, queue, worker_id
        self.interval_s, self.grace_s = interval_s, grace_s
        self.metrics = metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def run_once(self) -> None:
        lock = self.queue.client.set(self.queue.keys.reconcile_lock(self.queue.model),
                                     self.worker_id, nx=True, px=int(self.interval_s * 1000))
        if not lock:
            return
        report = reconcile(self.store, self.queue, self.grace_s)
        for _ in report.expired:
            self.metrics.job_finished(JobStatus.EXPIRED.value)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except (SQLAlchemyError, redis.RedisError) as exc:
                log.warning("reconciler skipped: %s", short_error(exc))
            except Exception:  # never let a bug here end reconciliation silently
                log.exception("reconciler pass failed")
            self._stop.wait(self.interval_s)
