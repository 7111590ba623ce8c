"""Storing finished jobs: one SQL transaction per loop pass, then acks and notices.

Nothing is acknowledged before its result is stored. A database outage keeps results here
(retried with backoff); a result the database refuses is stored as a failure naming the
reason, and if even that is refused, as a bare failure; a job whose every form is refused is
given up on (acked, logged) so one bad row never blocks the worker.
"""

from __future__ import annotations

import logging
import os
import time

from sqlalchemy.exc import SQLAlchemyError

from jobs.queue import Delivery
from jobs.schemas import JobStatus, Outcome
from jobs.store import DeliveryStore
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.retry import Backoff, is_outage, short_error

log = logging.getLogger(__name__)

# A failpoint for the reliability suite: with KVBATCH_FAILPOINT=exit-after-commit the process
# dies right after storing results and before acknowledging any of them, the narrowest window
# of at-least-once delivery. Read once; unset in production.
EXIT_AFTER_COMMIT = os.environ.get("KVBATCH_FAILPOINT") == "exit-after-commit"


class ResultWriter:
    """Finished jobs not yet stored, and how to store them."""

    def __init__(self, store: DeliveryStore, worker_id: str, outbox: Outbox,
                 metrics: WorkerMetrics) -> None:
        self.store = store
        self.worker_id = worker_id
        self.outbox = outbox
        self.metrics = metrics
        self.unsaved: list[tuple[Outcome, Delivery | None]] = []
        self.backoff = Backoff()

    def __len__(self) -> int:
        return len(self.unsaved)

    def add(self, outcome: Outcome, delivery: Delivery | None) -> None:
        self.unsaved.append((outcome, delivery))

    def flush(self, now: float | None = None) -> None:
        """Store what waits in one transaction; queue its acks and notices in the outbox."""
        now = time.time() if now is None else now
        if not self.unsaved or not self.backoff.ready(now):
            return
        batch = self.unsaved
        try:
            newly = self.store.finish([o for o, _ in batch], worker_id=self.worker_id)
        except SQLAlchemyError as exc:
            if is_outage(exc):
                self._outage(now, exc, len(batch))
                return
            try:  # maybe one result the database refuses: isolate it
                newly = self._one_by_one(batch)
            except SQLAlchemyError as exc2:
                self._outage(now, exc2, len(batch))
                return
        if EXIT_AFTER_COMMIT:
            os._exit(137)
        self.backoff.ok()
        self.unsaved = self.unsaved[len(batch):]
        self.outbox.ack([d.entry_id for _, d in batch if d is not None])
        for outcome, _ in batch:
            if outcome.job_id in newly:
                self.outbox.notify(outcome.job_id, outcome.status.value)
                self.metrics.job_finished(outcome.status.value)

    def _outage(self, now: float, exc: SQLAlchemyError, n: int) -> None:
        self.backoff.failed(now)
        log.warning("database unavailable (%s); %d results wait, unacked", short_error(exc), n)

    def _one_by_one(self, batch: list[tuple[Outcome, Delivery | None]]) -> set[str]:
        """Store outcomes singly, falling back for each the database refuses: a failure with
        the reason and the stats, then a bare failure (no stats, no worker id). Raises only
        for an outage (then the whole batch is retried: what was stored is a no-op then, as
        terminal transitions are guarded)."""
        newly: set[str] = set()
        for outcome, _ in batch:
            try:
                newly |= self._store_one(outcome, self.worker_id)
                continue
            except SQLAlchemyError as exc:
                if is_outage(exc):
                    raise
                reason = short_error(exc)
            log.error("job %s: the database refused its result: %s", outcome.job_id, reason)
            error = f"could not store the result: {reason}"
            fallbacks = ((Outcome(outcome.job_id, JobStatus.FAILED, outcome.finished_at,
                                  error=error, stats=outcome.stats), self.worker_id),
                         (Outcome(outcome.job_id, JobStatus.FAILED, outcome.finished_at,
                                  error=error), None))
            for fallback, worker_id in fallbacks:
                try:
                    newly |= self._store_one(fallback, worker_id)
                    break
                except SQLAlchemyError as exc:
                    if is_outage(exc):
                        raise
                    log.error("job %s: the database refused a fallback too: %s",
                              outcome.job_id, short_error(exc))
            else:
                log.error("job %s: giving up on storing it; its entry is acked and its row "
                          "stays active for the reconciler", outcome.job_id)
        return newly

    def _store_one(self, outcome: Outcome, worker_id: str | None) -> set[str]:
        return self.store.finish([outcome], worker_id=worker_id)
