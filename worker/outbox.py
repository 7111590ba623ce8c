"""Redis writes the worker owes: acks, dead letters and completion notices.

Each is queued here *before* any Redis I/O and removed only once Redis took it, so a Redis
failure in the middle of a pass delays them but never drops one (a dropped ack would leave
the entry pending forever; a dropped notice would leave a waiter polling).
"""

from __future__ import annotations

from jobs.queue import Delivery, JobQueue


class Outbox:
    def __init__(self, queue: JobQueue) -> None:
        self.queue = queue
        self.acks: list[Delivery] = []
        self.dead: list[tuple[Delivery, str]] = []
        self.done: list[tuple[str, str]] = []

    def __bool__(self) -> bool:
        return bool(self.acks or self.dead or self.done)

    def ack(self, deliveries: list[Delivery]) -> None:
        self.acks += deliveries

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self.dead.append((delivery, reason))

    def notify(self, job_id: str, status: str) -> None:
        self.done.append((job_id, status))

    def flush(self) -> None:
        """Send everything; raises ``redis.RedisError`` with the unsent part still queued
        (first in line again)."""
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
            self.dead, self.acks, self.done = dead + self.dead, acks + self.acks, done + self.done
