"""The feeder: SQL holds each model's backlog, Redis a bounded window of it.

A job is stored ``queued`` and not fed; the feeder moves jobs from the backlog into the model's
stream while the stream holds fewer entries (waiting or held by a worker) than the window: what
the live workers asked for together (``kvbatch worker --feed-window``, by default twice a
worker's capacity), at least :data:`MIN_WINDOW`. It takes them in priority order, round-robin
over tenants, then their batches, within a priority (``FeedStore.take``), marks them fed in
SQL, then adds them to the stream. Producers feed right after they store jobs; every worker
feeds from its maintenance thread after it pulls and at least every second. So Redis holds a
few times the fleet's capacity, however large the backlog; and a better priority or a new small
batch waits behind at most one window, never behind the backlog.

A job marked fed whose stream entry is lost (a crash between the SQL commit and the ``XADD``,
Redis restarted empty) is put back by the reconciler (``jobs.reconcile``), which reads only the
fed jobs.
"""

from __future__ import annotations

import logging

from jobs.lease import Lease
from jobs.queue import JobQueue
from jobs.schemas import JobStatus
from jobs.store.feed import FeedStore

log = logging.getLogger(__name__)

MIN_WINDOW = 256  # entries kept in a stream when no live worker asked for more
FEED_CHUNK = 1000  # jobs per SQL transaction and Redis pipeline
LEASE_TTL_S = 10.0


class Feeder:
    """Keeps ``queue``'s stream filled from its model's SQL backlog."""

    def __init__(self, queue: JobQueue, store: FeedStore, min_window: int = MIN_WINDOW) -> None:
        self.queue, self.store, self.min_window = queue, store, min_window

    def room(self) -> int:
        """How many more entries the stream takes now (negative when over the window)."""
        return self.queue.window(self.min_window) - self.queue.length()

    def feed(self) -> int:
        """Fill the window from the backlog; returns how many jobs were fed. Does nothing when
        the window is full or another process is feeding this model."""
        if self.room() <= 0:
            return 0
        # A feeder that stalls past the lease feeds at most one chunk too many: the window
        # overflows by that much once, nothing is lost or fed twice (``FeedStore.take`` marks
        # rows fed in SQL first), so its writes need no fencing.
        lease = Lease(self.queue.client, self.queue.keys.feed_lock(self.queue.model),
                      LEASE_TTL_S)
        if not lease.acquire():
            return 0
        fed = 0
        try:
            while (room := self.room()) > 0:
                specs, failed = self.store.take(self.queue.model, min(room, FEED_CHUNK))
                if failed:
                    log.warning("failed %d stored %s jobs that no longer validate", len(failed),
                                self.queue.model)
                    self.queue.publish_done((job_id, JobStatus.FAILED.value) for job_id in failed)
                if not specs:
                    if not failed:
                        break
                    continue
                self.queue.enqueue(specs)
                fed += len(specs)
        finally:
            lease.release()
        return fed
