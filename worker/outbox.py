"""Redis writes the worker owes: acks, dead letters and completion notices.

Each is queued here *before* any Redis I/O and removed only once Redis took it, so a Redis
failure in the middle of a pass delays them but never drops one (a dropped ack would leave
the entry pending forever; a dropped notice would leave a waiter polling).

A worker has one: the loop queues what its intake settles (copies, dead letters, jobs ended
before they ran), the result writer what it stored, and either thread sends it.
"""

from __future__ import annotations

import threading

from jobs.queue import Delivery, JobQueue


class Outbox:
    """Safe from any thread; :meth:`flush` sends what was queued when it began."""

    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue
        self._lock = threading.Lock()
        self.acks: list[Delivery] = []
        self.dead: list[tuple[Delivery, str]] = []
        self.done: list[tuple[str, str]] = []

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self.acks or self.dead or self.done)

    def ack(self, deliveries: list[Delivery]) -> None:
        with self._lock:
            self.acks += deliveries

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        with self._lock:
            self.dead.append((delivery, reason))

    def notify(self, job_id: str, status: str) -> None:
        with self._lock:
            self.done.append((job_id, status))

    def flush(self) -> None:
        """Send everything; raises ``redis.RedisError`` with the unsent part still queued
        (first in line again)."""
        with self._lock:
            dead, self.dead = self.dead, []
            acks, self.acks = self.acks, []
            done, self.done = self.done, []
        try:
            if dead:
                self.queue.dead_letter([d for d, _ in dead], [r for _, r in dead])
                dead = []
            if acks:
                self.queue.ack(acks)
                acks = []
            if done:
                self.queue.publish_done(done)
                done = []
        finally:
            with self._lock:
                self.dead, self.acks = dead + self.dead, acks + self.acks
                self.done = done + self.done
