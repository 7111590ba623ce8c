"""Following jobs to their end: the bookkeeping shared by the sync and async clients.

Workers store a job's result in SQL, then publish ``{"id", "status"}`` on the done channel.
A follower subscribes first, then reads SQL: jobs the channel names are read at once, and a
poll every ``poll_interval_s`` catches what the channel missed (a waiter that subscribed
late, a worker that died between commit and publish). The drivers (:meth:`JobClient.follow`,
``AsyncClient``) only move messages and call :meth:`Follower.take`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

from jobs.schemas import JobInfo
from jobs.store import JobReader


class Follower:
    """Which of a set of jobs are still to be reported, and when to look at SQL again.

    Args:
        store: the job store.
        job_ids: the jobs to follow.
        timeout_s: give up after this long (None: never).
        poll_interval_s: how often SQL is read when no notice arrives.
        batch_id: set when ``job_ids`` are the whole batch: the poll then compares the
            batch's count of terminal jobs first and reads ids only when they disagree.
    """

    def __init__(self, store: JobReader, job_ids: Collection[str], timeout_s: float | None,
                 poll_interval_s: float = 1.0, batch_id: str | None = None) -> None:
        self.store = store
        self.pending = set(job_ids)
        self.reported = 0
        self.batch_id = batch_id
        self.poll_interval_s = poll_interval_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._next_poll = 0.0  # the first take() reads SQL
        self._noticed: set[str] = set()

    def notice(self, message: dict[str, Any] | None) -> None:
        """Record a done-channel message (a pub/sub message dict, or None)."""
        job_id = done_job_id(message)
        if job_id is not None:
            self.notice_id(job_id)

    def notice_id(self, job_id: str) -> None:
        """Record that ``job_id`` was announced done."""
        if job_id in self.pending:
            self._noticed.add(job_id)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def wait_s(self) -> float:
        """How long a driver may block on the channel before calling :meth:`take` again."""
        now = time.monotonic()
        until = self._next_poll if self.deadline is None else min(self._next_poll, self.deadline)
        return max(0.0, until - now)

    def take(self) -> list[JobInfo]:
        """Blocking SQL: the pending jobs that are terminal now, oldest finish first."""
        noticed, polled = self._due()
        if not noticed and not polled:
            return []
        infos = [i for i in self.store.get_many(sorted(noticed | polled)) if i.status.terminal]
        infos.sort(key=lambda i: (i.finished_at is None, i.finished_at))
        self._report({i.id for i in infos})
        return infos

    def take_ids(self) -> set[str]:
        """As :meth:`take`, but only the ids: no result is read (waiting, not collecting)."""
        noticed, polled = self._due()
        done = polled | (self.store.terminal_ids(sorted(noticed)) if noticed else set())
        self._report(done)
        return done

    def _due(self) -> tuple[set[str], set[str]]:
        """(pending jobs announced done, pending jobs a poll found terminal, if one is due)."""
        noticed = self._noticed & self.pending
        self._noticed.clear()
        polled: set[str] = set()
        if time.monotonic() >= self._next_poll:
            polled = self._poll()
            self._next_poll = time.monotonic() + self.poll_interval_s
        return noticed - polled, polled

    def _report(self, done: set[str]) -> None:
        self.pending -= done
        self.reported += len(done)

    def _poll(self) -> set[str]:
        if self.batch_id is not None:
            counts = self.store.count_by_status(batch_id=self.batch_id)
            if sum(n for s, n in counts.items() if s.terminal) <= self.reported:
                return set()
        return self.store.terminal_ids(sorted(self.pending))


def done_job_id(message: dict[str, Any] | None) -> str | None:
    """The job id a done-channel message announces (None for anything else)."""
    if not message or message.get("type") != "message":
        return None
    try:
        job_id = json.loads(message["data"]).get("id")
    except (ValueError, AttributeError):
        return None
    return job_id if isinstance(job_id, str) else None
