"""Following jobs to their end: the bookkeeping shared by the sync and async clients.

Workers store a job's result in SQL, then publish ``{"id", "status"}`` on the done channel.
Each client holds one :class:`NoticeHub`: one subscription to the channel and one SQL poll
for all its followers (threads of a sync client, tasks of an async one), so ten thousand
concurrent waits cost one Redis connection and a batched ``IN`` read a second, not one each.
A notice wakes only the followers of the job it names; the poll catches what the channel
missed (a waiter that subscribed late, a worker that died between commit and publish).
A :class:`Follower` for a whole batch polls by itself instead: it compares the batch's count
of terminal jobs, one cheap query, rather than reading every id.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import redis

from jobs.schemas import JobInfo
from jobs.store import JobReader

log = logging.getLogger(__name__)

HUB_TICK_S = 0.05  # the longest a new follower waits for the hub's first poll of its jobs
POLL_CHUNK = 1000  # job ids per SQL read of the shared poll
SAFETY_WAKE_S = 5.0  # a hub follower looks again at least this often (the hub may have died)
HUB_IDLE_EXIT_S = 10.0  # the hub's thread ends (and unsubscribes) after this long unused


class Follower:
    """Which of a set of jobs are still to be reported, and when to look at SQL again.

    Args:
        store: the job store.
        job_ids: the jobs to follow.
        timeout_s: give up after this long (None: never).
        poll_interval_s: how often SQL is read when no notice arrives.
        batch_id: set when ``job_ids`` are the whole batch: the follower then polls by
            itself, comparing the batch's count of terminal jobs first and reading ids only
            when they disagree. Otherwise its client's :class:`NoticeHub` polls for it.
    """

    def __init__(self, store: JobReader, job_ids: Collection[str], timeout_s: float | None,
                 poll_interval_s: float = 1.0, batch_id: str | None = None) -> None:
        self.store = store
        self.pending = set(job_ids)
        self.reported = 0
        self.batch_id = batch_id
        self.shared_poll = batch_id is None
        self.poll_interval_s = poll_interval_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._next_poll = 0.0  # a batch follower's first take() reads SQL
        self._noticed: set[str] = set()
        self._lock = threading.Lock()  # notices come from the hub's thread

    def notice_id(self, job_id: str) -> None:
        """Record that ``job_id`` was announced done (or found terminal by the hub's poll)."""
        with self._lock:
            if job_id in self.pending:
                self._noticed.add(job_id)

    def add(self, job_ids: Collection[str]) -> None:
        """Follow ``job_ids`` too (its client's hub must be told: ``JobClient.follow_more``)."""
        with self._lock:
            self.pending |= set(job_ids)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def wait_s(self) -> float:
        """How long a driver may block before calling :meth:`take` again."""
        now = time.monotonic()
        until = now + SAFETY_WAKE_S if self.shared_poll else self._next_poll
        if self.deadline is not None:
            until = min(until, self.deadline)
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
        with self._lock:
            noticed, self._noticed = self._noticed & self.pending, set()
        polled: set[str] = set()
        if not self.shared_poll and time.monotonic() >= self._next_poll:
            polled = self._poll()
            self._next_poll = time.monotonic() + self.poll_interval_s
        return noticed - polled, polled

    def _report(self, done: set[str]) -> None:
        with self._lock:
            self.pending -= done
        self.reported += len(done)

    def _poll(self) -> set[str]:
        if self.batch_id is not None:
            counts = self.store.count_by_status(batch_id=self.batch_id)
            if sum(n for s, n in counts.items() if s.terminal) <= self.reported:
                return set()
        return self.store.terminal_ids(sorted(self.pending))


class NoticeHub:
    """One client's followers, woken by one done-channel subscription and one SQL poll.

    A daemon thread, started by the first follower, reads the channel; every poll interval
    (the shortest its shared-poll followers asked for) it reads which of their jobs are
    terminal, :data:`POLL_CHUNK` ids a query, and right after followers join, which of
    theirs. Each hit is recorded on
    the jobs' followers and wakes them (``wake`` may hand over to an event loop). If Redis
    fails, the thread subscribes again a second later; the poll goes on meanwhile.
    """

    def __init__(self, client: redis.Redis, channel: str, store: JobReader) -> None:
        self.client, self.channel, self.store = client, channel, store
        self._lock = threading.Lock()
        self._by_job: dict[str, dict[int, tuple[Follower, Callable[[], None]]]] = {}
        self._jobs_of: dict[int, list[str]] = {}
        self._wake_of: dict[int, Callable[[], None]] = {}
        self._joined: list[str] = []  # jobs of followers that joined since the last poll
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        """How many followers are registered."""
        return len(self._jobs_of)

    def add(self, follower: Follower, wake: Callable[[], None]) -> None:
        """Deliver notices for ``follower``'s pending jobs; ``wake()`` after each one."""
        with self._lock:
            self._wake_of[id(follower)] = wake
            self._register(follower, list(follower.pending))
            if self._thread is None or not self._thread.is_alive():
                self._closed.clear()
                self._thread = threading.Thread(target=self._run, name="kvbatch-notices",
                                                daemon=True)
                self._thread.start()

    def extend(self, follower: Follower, job_ids: Collection[str]) -> None:
        """Deliver notices for ``job_ids`` too to ``follower`` (added before)."""
        with self._lock:
            self._register(follower, list(job_ids))

    def _register(self, follower: Follower, job_ids: list[str]) -> None:
        wake = self._wake_of[id(follower)]
        self._jobs_of.setdefault(id(follower), []).extend(job_ids)
        for job_id in job_ids:
            self._by_job.setdefault(job_id, {})[id(follower)] = (follower, wake)
        if follower.shared_poll:
            self._joined += job_ids

    def remove(self, follower: Follower) -> None:
        with self._lock:
            self._wake_of.pop(id(follower), None)
            for job_id in self._jobs_of.pop(id(follower), []):
                waiting = self._by_job.get(job_id)
                if waiting is not None:
                    waiting.pop(id(follower), None)
                    if not waiting:
                        del self._by_job[job_id]

    def close(self) -> None:
        """Stop the thread (it unsubscribes); a later :meth:`add` starts it again."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def notice(self, job_id: str | None) -> None:
        """``job_id`` is done: tell its followers and wake them."""
        with self._lock:
            waiting = list(self._by_job.get(job_id or "", {}).values())
        for follower, wake in waiting:
            follower.notice_id(job_id or "")
            with contextlib.suppress(RuntimeError):  # its event loop closed: it waits no more
                wake()

    def _poll(self, everyone: bool) -> float:
        """Read which followed jobs are terminal (all, or those of followers that just
        joined); returns the interval to the next full poll."""
        with self._lock:
            shared = {job_id: min(f.poll_interval_s for f, _ in waiting.values())
                      for job_id, waiting in self._by_job.items()
                      if any(f.shared_poll for f, _ in waiting.values())}
            ids = list(shared) if everyone else [j for j in self._joined if j in shared]
            self._joined = []
        for start in range(0, len(ids), POLL_CHUNK):
            for job_id in self.store.terminal_ids(ids[start:start + POLL_CHUNK]):
                self.notice(job_id)
        return min(shared.values(), default=1.0)

    def _run(self) -> None:
        pubsub: Any = None
        next_poll = 0.0
        retry_at = 0.0
        idle_since = time.monotonic()
        while not self._closed.is_set():
            with self._lock:  # nobody to wake for a while: leave (the next add() restarts it)
                if self._jobs_of:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > HUB_IDLE_EXIT_S:
                    self._thread = None
                    break
            try:
                if pubsub is None and time.monotonic() >= retry_at:
                    pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.channel)  # before the poll that follows a join
                if pubsub is not None:
                    message = pubsub.get_message(timeout=HUB_TICK_S)
                    while message is not None:
                        self.notice(done_job_id(message))
                        message = pubsub.get_message(timeout=0)
                else:
                    self._closed.wait(HUB_TICK_S)
            except (redis.RedisError, OSError, ValueError) as exc:  # a socket closed under it
                log.warning("done channel unavailable (%s); polling SQL meanwhile", exc)
                pubsub = _close(pubsub)
                retry_at = time.monotonic() + 1.0
            everyone = time.monotonic() >= next_poll
            if everyone or self._joined:
                try:
                    interval = self._poll(everyone)
                except Exception as exc:  # a database outage: the next poll tries again
                    log.warning("polling job statuses failed: %s", exc)
                    interval = 1.0
                if everyone:
                    next_poll = time.monotonic() + interval
        _close(pubsub)


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        with contextlib.suppress(redis.RedisError, OSError, ValueError):
            pubsub.close()


def done_job_id(message: dict[str, Any] | None) -> str | None:
    """The job id a done-channel message announces (None for anything else)."""
    if not message or message.get("type") != "message":
        return None
    try:
        job_id = json.loads(message["data"]).get("id")
    except (ValueError, AttributeError):
        return None
    return job_id if isinstance(job_id, str) else None
