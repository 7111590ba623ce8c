"""The worker's lease, renewed from its own thread.

The loop's pass can take long (a slow database, a large batch of results); the lease must
not lapse because of that, or live workers would steal jobs that are still running. But a
loop that is truly stuck must lose its lease, so its jobs move on: the thread renews only
while the loop reported progress within ``stall_s``.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from jobs.queue import JobQueue

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews ``worker_id``'s heartbeat every ``lease_ttl_s / 3`` while the loop makes
    progress (calls :meth:`progress`) at least every ``stall_s``; each beat also asks for
    ``window`` jobs in the stream (``jobs.feed``)."""

    def __init__(self, queue: JobQueue, worker_id: str, lease_ttl_s: float,
                 stall_s: float, window: int, adapters: tuple[str, ...] = (),
                 cpu_host: str | None = None) -> None:
        self.queue = queue
        self.worker_id = worker_id
        self.window = window
        self.adapters = adapters  # announced with each beat (JobQueue.heartbeat)
        self.cpu_host = cpu_host  # the host whose cores the engine shares (worker.cpu_share)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.interval_s = lease_ttl_s / 3
        self.stall_s = stall_s
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def progress(self) -> None:
        self._last_progress = time.monotonic()

    def stop(self) -> None:
        """Stop renewing (the caller drops the key, or lets it expire)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 5)

    def _run(self) -> None:
        stalled = False
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self._last_progress > self.stall_s:
                if not stalled:
                    log.error("worker loop made no progress for %.0fs; letting the lease lapse",
                              self.stall_s)
                stalled = True
                continue
            stalled = False
            try:
                self._beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _beat(self) -> None:
        self.queue.heartbeat(self.worker_id, self.lease_ttl_ms, self.window, self.adapters,
                             self.cpu_host)
