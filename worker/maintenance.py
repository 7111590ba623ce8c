"""The worker's queue upkeep, on its own thread so that a slow pass (a slow database, a large
backlog) never delays the worker loop or its lease: it feeds the model's stream from the SQL
backlog (``jobs.feed``) and reconciles the stream against SQL (``jobs.reconcile``)."""

from __future__ import annotations

import logging
import threading
import time

import redis
from sqlalchemy.exc import SQLAlchemyError

from jobs.feed import Feeder
from jobs.lease import Lease
from jobs.reconcile import reconcile
from jobs.schemas import JobStatus
from jobs.store import MaintenanceStore
from worker.metrics import WorkerMetrics
from worker.retry import short_error

log = logging.getLogger(__name__)

FEED_INTERVAL_S = 1.0  # the longest wait between feeds; the loop's pulls wake it sooner
FEED_GAP_S = 0.05  # the shortest: the loop wakes it on every pass that pulled jobs
BACKLOG_INTERVAL_S = 10.0  # how often the SQL backlog is counted (kvbatch_queue_backlog)


class UpkeepThread:
    """Feeds after every :meth:`wake` and at least every :data:`FEED_INTERVAL_S`; every
    ``reconcile_interval_s`` (and once at start), if no other worker of the model holds the
    reconcile lock, runs :func:`jobs.reconcile.reconcile` first; every
    :data:`BACKLOG_INTERVAL_S` (and once at start) counts the SQL backlog for the
    ``queue_backlog`` gauge."""

    def __init__(self, feeder: Feeder, store: MaintenanceStore, reconcile_interval_s: float,
                 grace_s: float, metrics: WorkerMetrics) -> None:
        self.feeder, self.store = feeder, store
        self.queue = feeder.queue
        self.interval_s, self.grace_s = reconcile_interval_s, grace_s
        self.metrics = metrics
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="upkeep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """The stream lost entries (this worker pulled): feed now."""
        self._wake.set()

    def reconcile_once(self) -> None:
        # Held for the interval, not released: one pass per interval over all the workers.
        if not Lease(self.queue.client, self.queue.keys.reconcile_lock(self.queue.model),
                     self.interval_s).acquire():
            return
        report = reconcile(self.store, self.queue, self.grace_s)
        for _ in report.expired:
            self.metrics.job_finished(JobStatus.EXPIRED.value)

    def _run(self) -> None:
        reconcile_at = backlog_at = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if time.monotonic() >= reconcile_at:
                    reconcile_at = time.monotonic() + self.interval_s
                    self.reconcile_once()
                self.feeder.feed()
                if time.monotonic() >= backlog_at:
                    backlog_at = time.monotonic() + BACKLOG_INTERVAL_S
                    self.metrics.queue_backlog.set(self.feeder.store.backlog(self.queue.model))
            except (SQLAlchemyError, redis.RedisError) as exc:
                log.warning("queue upkeep skipped: %s", short_error(exc))
            except Exception:  # never let a bug here end feeding silently
                log.exception("queue upkeep pass failed")
            self._stop.wait(FEED_GAP_S)
            self._wake.wait(FEED_INTERVAL_S)
