"""Storing finished jobs, on a thread of their own: one SQL transaction for what gathered,
then its acks and notices.

The loop hands outcomes over and goes on pulling and deciding the next jobs while the last
ones are written, so a batch's SQL round trips overlap the next batch's. Nothing is
acknowledged before it is stored. A database outage keeps results here (retried with
backoff), a Redis outage keeps their acks and notices (likewise); a result the database
refuses is stored as a failure naming the reason, and if even that is refused, as a bare
failure; a job whose every form is refused is given up on (acked, logged) so one bad row never
blocks the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from jobs.queue import Delivery
from jobs.schemas import JobStatus, Outcome
from jobs.store import DeliveryStore
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.retry import Backoff, RedisBackoff, is_outage, short_error

log = logging.getLogger(__name__)

# While the database or Redis is backing off, the writer looks again this often.
RETRY_WAIT_S = 0.05


class ResultWriter:
    """Finished jobs not yet stored and acknowledged, and the thread that stores them.

    :meth:`add` is safe from any thread; :meth:`flush` is one pass of the writer (its thread
    runs it after :meth:`start`; call it directly only while the thread is not running).

    Args:
        store: where outcomes are stored.
        worker_id: the worker named in the stored rows.
        outbox: the worker's outbox, for the acks and notices of stored results (the writer
            sends it too).
        redis_backoff: the worker's Redis backoff, pacing those sends.
        metrics: counts the jobs finished.
        after_commit: called on the writer's thread each time a transaction stored results,
            before any of them is acknowledged (a test's way to crash in that window).
    """

    def __init__(self, store: DeliveryStore, worker_id: str, outbox: Outbox,
                 redis_backoff: RedisBackoff, metrics: WorkerMetrics, *,
                 after_commit: Callable[[], None] | None = None) -> None:
        self.store = store
        self.worker_id = worker_id
        self.outbox = outbox
        self.metrics = metrics
        self.backoff = Backoff()  # the database
        self.redis_backoff = redis_backoff
        self.after_commit = after_commit
        self._unsaved: list[tuple[Outcome, Delivery | None]] = []
        self._storing = 0  # outcomes of the transaction under way
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="results", daemon=True)

    def __len__(self) -> int:
        """Outcomes not stored yet."""
        with self._changed:
            return len(self._unsaved) + self._storing

    def __bool__(self) -> bool:
        """Anything owed: outcomes to store, acks or notices to send."""
        with self._changed:
            return bool(self._unsaved or self._storing or self.outbox)

    def add(self, outcome: Outcome, delivery: Delivery | None) -> None:
        with self._changed:
            self._unsaved.append((outcome, delivery))
            self._changed.notify_all()

    def start(self) -> None:
        self._thread.start()

    def wait_stored(self, timeout_s: float) -> None:
        """Block until the writer ends a transaction, or ``timeout_s``: for a loop whose
        capacity is held by results being stored."""
        with self._changed:
            if self._unsaved or self._storing:
                self._changed.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """End the thread after the pass under way (what is left stays here); False if it is
        still in that pass after ``timeout_s`` (then leave :meth:`flush` to it)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def last_flush(self) -> None:
        """Stop the thread, then try once more, backoffs or not, to store what is left and
        send what is owed (a stopping worker's last chance)."""
        if not self.stop():
            log.warning("the result writer is still busy; its results stay unacked")
            return
        self.backoff.ok()
        self.redis_backoff.reset()
        self.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._changed:  # idle: sleep until add() or stop() (no timer waking it)
                if not self._unsaved and not self.outbox and not self._stop.is_set():
                    self._changed.wait()
                    continue
            try:
                self.flush()
            except Exception:  # a bug here must not end the thread: results would pile up
                log.exception("storing results failed; retrying")
                self.backoff.failed(time.time())
            if not self.backoff.ready(time.time()) or not self.redis_backoff.ready(time.time()):
                self._stop.wait(RETRY_WAIT_S)

    def flush(self, now: float | None = None) -> None:
        """Store what waits in one transaction, then send the acks and notices owed."""
        now = time.time() if now is None else now
        self._store(now)
        if self.outbox:
            self.redis_backoff.call(now, self.outbox.flush)

    def _store(self, now: float) -> None:
        with self._changed:
            if not self._unsaved or not self.backoff.ready(now):
                return
            batch, self._unsaved = self._unsaved, []
            self._storing = len(batch)
        newly: dict[str, JobStatus] | None = None
        try:
            newly = self._finish(batch, now)
            if newly is not None and self.after_commit is not None:
                self.after_commit()
        finally:
            with self._changed:  # owed as acks before it stops being owed as outcomes
                if newly is None:  # not stored: first in line again
                    self._unsaved = batch + self._unsaved
                else:
                    self.outbox.ack([d for _, d in batch if d is not None])
                    for job_id, status in newly.items():  # the status stored, once a job
                        self.outbox.notify(job_id, status.value)
                        self.metrics.job_finished(status.value)
                self._storing = 0
                self._changed.notify_all()  # wait_stored()
        if newly is not None:
            self.backoff.ok()

    def _finish(self, batch: list[tuple[Outcome, Delivery | None]],
                now: float) -> dict[str, JobStatus] | None:
        """The jobs ``batch`` made terminal, each with the status stored (a job's first
        outcome in the batch is the one stored); None if the database is unavailable."""
        try:
            ended = self.store.finish([o for o, _ in batch], worker_id=self.worker_id)
            newly: dict[str, JobStatus] = {}
            for o, _ in batch:
                if o.job_id in ended:
                    newly.setdefault(o.job_id, o.status)
            return newly
        except Exception as exc:  # whatever it is, one result must not block all
            if _is_outage(exc):
                self._outage(now, exc, len(batch))
                return None
            try:  # maybe one result the database refuses (or cannot be written): isolate it
                return self._one_by_one(batch)
            except SQLAlchemyError as exc2:
                self._outage(now, exc2, len(batch))
                return None

    def _outage(self, now: float, exc: Exception, n: int) -> None:
        self.backoff.failed(now)
        log.warning("database unavailable (%s); %d results wait, unacked", short_error(exc), n)

    def _one_by_one(self, batch: list[tuple[Outcome, Delivery | None]]) -> dict[str, JobStatus]:
        """Store outcomes singly, falling back for each the database refuses: a failure with
        the reason and the stats, then a bare failure (no stats, no worker id). Raises only
        for an outage (then the whole batch is retried: what was stored is a no-op then, as
        terminal transitions are guarded)."""
        newly: dict[str, JobStatus] = {}
        for outcome, _ in batch:
            try:
                for job_id in self._store_one(outcome, self.worker_id):
                    newly.setdefault(job_id, outcome.status)
                continue
            except Exception as exc:  # a result that cannot be written fails alone
                if _is_outage(exc):
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
                    for job_id in self._store_one(fallback, worker_id):
                        newly.setdefault(job_id, JobStatus.FAILED)
                    break
                except Exception as exc:
                    if _is_outage(exc):
                        raise
                    log.error("job %s: the database refused a fallback too: %s",
                              outcome.job_id, short_error(exc))
            else:
                log.error("job %s: giving up on storing it; its entry is acked and its row "
                          "stays active for the reconciler", outcome.job_id)
        return newly

    def _store_one(self, outcome: Outcome, worker_id: str | None) -> set[str]:
        return self.store.finish([outcome], worker_id=worker_id)


def _is_outage(exc: Exception) -> bool:
    return isinstance(exc, SQLAlchemyError) and is_outage(exc)
