"""The producer side: submit jobs, read them back, cancel them, wait for them.

:class:`JobClient` is the one object that holds a producer's connections (Redis, the key
names, the SQL stores); the SDK's ``Client``, its handles and the command line call it, never
the stores or queues behind it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, TypeVar

import redis
from sqlalchemy import Engine

from jobs.constants import DEFAULT_DATABASE_URL, DEFAULT_KEY_PREFIX, DEFAULT_REDIS_URL, Keys
from jobs.db import as_engine, require_database
from jobs.feed import Feeder
from jobs.follow import Follower, NoticeHub
from jobs.limits import JobLimits
from jobs.queue import JobQueue, live_adapters, live_workers, publish_done, signal_cancel
from jobs.schemas import (
    ADAPTER_SEPARATOR,
    BatchStatus,
    JobInfo,
    JobSpec,
    JobStatus,
    encode_job,
    queue_model,
)
from jobs.stats import Stats, aggregate
from jobs.store import BatchStore, FeedStore, JobReader, ProducerStore

log = logging.getLogger(__name__)

T = TypeVar("T")

ANALYZE_AFTER_ROWS = 50_000  # a bulk load this large refreshes the planner's statistics


# How long JobClient keeps the bare names of live workers' LoRA adapters before looking again.
ALIAS_REFRESH_S = 1.0

class JobClient:
    """Submit and follow jobs.

    Args:
        redis_client: a client with ``decode_responses=True`` (or pass ``redis_url``).
        database: a SQLAlchemy engine or a database URL.
        key_prefix: the Redis key prefix shared with the workers.
    """

    def __init__(
        self,
        redis_client: redis.Redis | None = None,
        database: Engine | str = DEFAULT_DATABASE_URL,
        *,
        redis_url: str = DEFAULT_REDIS_URL,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        self.redis = redis_client or redis.Redis.from_url(redis_url, decode_responses=True)
        self.keys = Keys(key_prefix)
        if isinstance(database, str):
            require_database(database)  # a typo'd SQLite path is an error, not a new file
        self.engine = as_engine(database)
        self.producer = ProducerStore(self.engine)
        self.reader = JobReader(self.engine)
        self.batches = BatchStore(self.engine)
        self.feed_store = FeedStore(self.engine)
        self.notices = NoticeHub(self.redis, self.keys.done_channel(), self.reader)
        self._feeders: dict[str, Feeder] = {}
        self.limits = JobLimits()
        self._behind = threading.local()  # store_behind's thread and chunk in flight
        # (when, live models, _adapter_aliases) as last looked up
        self._aliases: tuple[float, set[str], dict[str, str]] | None = None

    def close(self) -> None:
        """Release the Redis and database connections."""
        self.notices.close()
        self.redis.close()
        self.engine.dispose()

    def check(self, spec: JobSpec) -> None:
        """Raise ``ValueError`` when ``spec`` is over a limit: its wire size
        (``MAX_PAYLOAD_BYTES``) or one of :class:`jobs.limits.JobLimits`."""
        encode_job(spec)
        self.limits.check(spec)

    def submit(self, specs: Sequence[JobSpec]) -> list[str]:
        """Record ``specs`` as queued (one SQL transaction), then add them to their streams.

        Once this returns the jobs are durable: if the XADD fails, the reconciler enqueues
        them later. Raises ``ValueError`` for a job over a limit (:meth:`check`) and SQLAlchemy's
        ``IntegrityError`` for a duplicate id or (batch_id, custom_id).
        """
        for spec in specs:
            self.check(spec)  # before anything is stored
        self.store(specs)
        return [s.id for s in specs]

    @contextlib.contextmanager
    def store_behind(self) -> Iterator[None]:
        """Within it, :meth:`store` (of this thread) hands its chunk to one storing thread and
        returns once the chunk before is stored: the caller checks the next chunk while
        PostgreSQL takes this one (the database's waits release the GIL). At most one chunk
        is in flight. The jobs of a call are durable only once the next call, or leaving the
        block, returns: a chunk's failure raises there, and leaving on an error still stores
        the chunk in flight, so that what the caller counted as stored is."""
        if getattr(self._behind, "pool", None) is not None:  # nested: the outer one does it
            yield
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="kvbatch-store")
        self._behind.pool, self._behind.pending = pool, None
        try:
            yield
            self._settle()
        finally:
            pending = self._behind.pending
            self._behind.pool = self._behind.pending = None
            if pending is not None:  # leaving on an error, which is the one to raise
                try:
                    pending.result()
                except Exception as exc:  # logged: the error leaving the block is raised
                    log.warning("the chunk in flight was not stored either: %s", exc)
            pool.shutdown()

    def _settle(self) -> None:
        pending, self._behind.pending = self._behind.pending, None
        if pending is not None:
            pending.result()

    def store(self, specs: Sequence[JobSpec], *, webhook_url: str | None = None,
              deadline: datetime | None = None, fence: int | None = None) -> None:
        """Insert checked ``specs`` (one transaction) and hand them to the workers; a new
        batch row takes ``webhook_url`` and ``deadline``. Callers check first (:meth:`check`).
        ``fence``: the token of the batch's lease (``jobs.lease``) its writer holds; nothing
        is stored if it is not the newest (``LeaseLost``).

        Jobs of a model whose stream has room for them, with no backlog in SQL, go to the
        stream at once; otherwise they join the backlog and the feeder (``jobs.feed``) moves
        them when there is room, in priority and fair-share order. Within
        :meth:`store_behind`, another thread does it."""
        specs = self._resolve_adapters(specs)
        pool = getattr(self._behind, "pool", None)
        if pool is None:
            self._store(specs, webhook_url, deadline, fence)
        else:
            self._settle()
            self._behind.pending = pool.submit(self._store, specs, webhook_url, deadline, fence)

    def _resolve_adapters(self, specs: Sequence[JobSpec]) -> Sequence[JobSpec]:
        # A job naming a LoRA adapter by its bare name (as vLLM's --lora-modules) gets the
        # name <model>:<adapter> of the one live model serving it, so it joins that queue.
        # Looked up again at once for a name that is neither a live model nor a known adapter.
        known = self._aliases[1] | set(self._aliases[2]) if self._aliases else set()
        fresh = any(s.model not in known and ADAPTER_SEPARATOR not in s.model for s in specs)
        aliases = self._adapter_aliases(fresh)
        if not aliases or not any(s.model in aliases for s in specs):
            return specs
        return [s.model_copy(update={"model": aliases[s.model]}) if s.model in aliases else s
                for s in specs]

    def _adapter_aliases(self, fresh: bool = False) -> dict[str, str]:
        """Bare adapter name -> ``<model>:<adapter>`` for the adapters of live workers that
        one model serves and no model is named as (unless ``fresh``, looked up at most every
        :data:`ALIAS_REFRESH_S`)."""
        now = time.monotonic()
        if fresh or self._aliases is None or now - self._aliases[0] > ALIAS_REFRESH_S:
            bases = set(live_workers(self.redis, self.keys).values())
            by_name: dict[str, set[str]] = defaultdict(set)
            for full in live_adapters(self.redis, self.keys):
                by_name[full.partition(ADAPTER_SEPARATOR)[2]].add(full)
            self._aliases = (now, bases, {name: min(full) for name, full in by_name.items()
                                          if len(full) == 1 and name not in bases})
        return self._aliases[2]

    def _store(self, specs: Sequence[JobSpec], webhook_url: str | None,
               deadline: datetime | None, fence: int | None) -> None:
        by_model: dict[str, list[JobSpec]] = defaultdict(list)
        for spec in specs:
            by_model[queue_model(spec.model)].append(spec)
        direct = {model for model, group in by_model.items() if self._has_room(model, len(group))}
        self.producer.insert_jobs(specs, webhook_url=webhook_url, deadline=deadline, fed=direct,
                                  fence=fence)
        for model, group in by_model.items():
            feeder = self._feeder(model)
            try:
                if model in direct:
                    feeder.queue.enqueue(group)
                else:
                    feeder.feed()
            except redis.RedisError as exc:
                log.warning("jobs stored but not enqueued (%s); the workers will", exc)

    def _feeder(self, model: str) -> Feeder:
        if model not in self._feeders:
            self._feeders[model] = Feeder(JobQueue(self.redis, model, self.keys), self.feed_store)
        return self._feeders[model]

    def _has_room(self, model: str, n: int) -> bool:
        """Whether ``n`` new jobs of ``model`` can skip the backlog: the window has room for
        them and nothing of the model waits in SQL (which would then be overtaken)."""
        try:
            return self._feeder(model).room() >= n and not self.feed_store.has_backlog(model)
        except redis.RedisError:
            return False

    def submit_batch(self, batch_id: str, specs: Sequence[JobSpec], chunk_size: int = 1000, *,
                     webhook_url: str | None = None, deadline: datetime | None = None,
                     over_limit: dict[str, str] | None = None,
                     new_rows: bool = False) -> dict[str, str]:
        """Submit the rows of batch ``batch_id`` it does not hold yet; ``custom_id`` is the key.

        Rows already in the batch (whatever their status) are neither inserted nor enqueued
        again, so resubmitting a batch never runs a row twice. Each chunk of ``chunk_size``
        rows is one SQL transaction and one Redis pipeline.

        Args:
            batch_id: the batch; every spec must carry it and a ``custom_id`` unique in it.
            specs: the rows.
            chunk_size: rows per transaction and pipeline.
            webhook_url: the batch's webhook, set by the transaction that creates the batch
                (an existing batch keeps its own).
            deadline: the batch's deadline, likewise.
            over_limit: when given, a new row over a limit is left out and put there
                (``custom_id`` -> why) instead of refusing the batch.
            new_rows: the caller knows the batch holds none of these rows (a new batch): they
                are not looked up.

        Returns:
            ``custom_id`` -> job id of every row of ``specs`` (stored before or now) but those
            left out.

        Raises:
            ValueError: a row over a limit (:meth:`check`, its ``custom_id`` named) unless
                ``over_limit`` is given, or duplicate ``custom_id``s; nothing was stored.
        """
        custom_ids = [s.custom_id for s in specs]
        if any(s.batch_id != batch_id or s.custom_id is None for s in specs):
            raise ValueError(f"every row needs batch_id {batch_id!r} and a custom_id")
        dups = [c for c, n in Counter(custom_ids).items() if n > 1]
        if dups:
            dup = dups[0]
            raise ValueError(f"custom_id {dup!r} appears more than once in batch {batch_id!r}")
        existing = {} if new_rows else self.reader.batch_job_ids_of(
            batch_id, [str(c) for c in custom_ids])
        new = []
        for spec in (s for s in specs if s.custom_id not in existing):  # all before storing
            try:
                self.check(spec)
            except ValueError as exc:
                if over_limit is None:
                    raise ValueError(f"row {spec.custom_id!r}: {exc}") from exc
                over_limit[str(spec.custom_id)] = str(exc)
                continue
            new.append(spec)
        for start in range(0, len(new), chunk_size):
            self.store(new[start:start + chunk_size], webhook_url=webhook_url,
                       deadline=deadline)
        return existing | {s.custom_id: s.id for s in new if s.custom_id is not None}

    def bulk_loaded(self, rows: int) -> None:
        """Tell the store that ``rows`` jobs were just stored in bulk: past
        :data:`ANALYZE_AFTER_ROWS`, the planner's statistics are refreshed at once."""
        if rows >= ANALYZE_AFTER_ROWS:
            self.producer.analyze()

    def batch_settings(self, batch_id: str) -> tuple[str | None, datetime | None] | None:
        """(webhook URL, deadline) of a batch; None when it does not exist yet."""
        return self.reader.batch_settings(batch_id)

    def configure_batch(self, batch_id: str, *, webhook_url: str | None = None,
                        deadline: datetime | None = None) -> None:
        """Set a batch's completion webhook and deadline (the batch must exist)."""
        self.producer.configure_batch(batch_id, webhook_url=webhook_url, deadline=deadline)

    def get(self, job_id: str) -> JobInfo | None:
        """The stored job ``job_id`` (None if unknown)."""
        return self.reader.get(job_id)

    def get_many(self, job_ids: Sequence[str]) -> list[JobInfo]:
        """The stored jobs among ``job_ids`` (unknown ids are left out), in no set order."""
        return self.reader.get_many(job_ids)

    def batch_jobs(self, batch_id: str) -> list[tuple[str, str | None, JobStatus]]:
        """(id, custom_id, status) of every job of ``batch_id``."""
        return self.reader.batch_jobs(batch_id)

    def count_by_status(self, batch_id: str | None = None) -> dict[JobStatus, int]:
        """How many jobs (of ``batch_id``) are in each status; statuses without jobs are
        absent."""
        return self.reader.count_by_status(batch_id=batch_id)

    def job_stats_rows(self, batch_id: str | None = None,
                       since: datetime | timedelta | None = None) -> list[dict[str, Any]]:
        """Per-job rows of the ``job_stats`` view (see ``JobReader.job_stats_rows``)."""
        return self.reader.job_stats_rows(batch_id, since)

    def stats(self, batch_id: str | None = None,
              since: datetime | timedelta | None = None) -> Stats:
        """Aggregate statistics of the jobs of ``batch_id`` and/or finished since ``since``."""
        return aggregate(self.reader.job_stats_rows(batch_id, since))

    def serves(self, model: str) -> bool:
        """Whether a live worker serves ``model``."""
        return model in self.served_models()

    def served_models(self) -> set[str]:
        """The models live workers serve, their LoRA adapters included: as
        ``<model>:<adapter>``, and by the adapter's name alone where one model serves it."""
        return (set(live_workers(self.redis, self.keys).values())
                | live_adapters(self.redis, self.keys) | set(self._adapter_aliases(fresh=True)))

    def follower(self, job_ids: Collection[str], timeout_s: float | None = None,
                 poll_interval_s: float = 1.0, batch_id: str | None = None) -> Follower:
        """The bookkeeping of following ``job_ids`` (see :meth:`follow`)."""
        return Follower(self.reader, job_ids, timeout_s, poll_interval_s, batch_id)

    @property
    def done_channel(self) -> str:
        """The pub/sub channel of completion notices."""
        return self.keys.done_channel()

    def cancel(self, job_id: str) -> JobStatus | None:
        """Cancel a job: a queued one at once, a running one by its worker (which aborts it
        in the engine). Returns the status right after the request; None if unknown."""
        status = self.producer.request_cancel(job_id, time.time())
        if status is JobStatus.RUNNING:
            signal_cancel(self.redis, self.keys, job_id)
        elif status is JobStatus.CANCELLED:
            publish_done(self.redis, self.keys, [(job_id, status.value)])
        return status

    def batch_status(self, batch_id: str) -> BatchStatus | None:
        """Where batch ``batch_id`` is in its lifecycle (None: unknown)."""
        return self.batches.status(batch_id)

    def cancel_batch(self, batch_id: str) -> int:
        """Cancel batch ``batch_id``: it ends ``cancelled`` once every job is terminal; its
        queued jobs are cancelled at once, running ones by their workers. Returns how many were
        cancelled or asked to stop."""
        self.batches.request_cancel(batch_id)
        cancelled, running = self.producer.cancel_batch(batch_id, time.time())
        for job_id in running:
            signal_cancel(self.redis, self.keys, job_id)
        for start in range(0, len(cancelled), 1000):
            publish_done(self.redis, self.keys, [(job_id, JobStatus.CANCELLED.value)
                                                 for job_id in cancelled[start:start + 1000]])
        model = self.reader.batch_model(batch_id)
        if cancelled and model is not None:  # their stream entries would wait for a worker
            JobQueue(self.redis, model, self.keys).drop(set(cancelled))
        return len(cancelled) + len(running)

    def wait(self, job_ids: Sequence[str], timeout_s: float = 60.0,
             poll_interval_s: float = 1.0) -> list[JobInfo]:
        """Block until all ``job_ids`` are terminal (or ``timeout_s`` passes); return them."""
        with contextlib.suppress(TimeoutError):
            self.wait_terminal(job_ids, timeout_s, poll_interval_s)
        return self.reader.get_many(list(job_ids))

    def wait_terminal(self, job_ids: Collection[str], timeout_s: float | None = None,
                      poll_interval_s: float = 1.0, batch_id: str | None = None) -> None:
        """Block until all ``job_ids`` are terminal, reading their ids and statuses only (no
        results); the arguments are :meth:`follow`'s. Raises ``TimeoutError``."""
        follower = self.follower(job_ids, timeout_s, poll_interval_s, batch_id)
        for _ in self._drive(follower, follower.take_ids):
            pass

    def follow(self, job_ids: Collection[str], timeout_s: float | None = None,
               poll_interval_s: float = 1.0, batch_id: str | None = None) -> Iterator[JobInfo]:
        """Yield each of ``job_ids`` once it is terminal, in completion order.

        Args:
            job_ids: the jobs to follow.
            timeout_s: raise ``TimeoutError`` if they are not all terminal by then.
            poll_interval_s: how often SQL is read when no completion notice arrives.
            batch_id: pass it when ``job_ids`` are the whole batch (cheaper polls).
        """
        follower = self.follower(job_ids, timeout_s, poll_interval_s, batch_id)
        yield from self._drive(follower, follower.take)

    def follow_open(self, follower: Follower) -> Iterator[list[JobInfo]]:
        """:meth:`follow` the jobs of ``follower`` (made by :meth:`follower`, with no
        ``batch_id``), the jobs found terminal by one read together, in completion order;
        :meth:`follow_more` may add jobs while this is iterated: it ends once none is left
        to report."""
        return self._drive(follower, lambda: [infos] if (infos := follower.take()) else [])

    def follow_more(self, follower: Follower, job_ids: Collection[str]) -> None:
        """Follow ``job_ids`` too within the :meth:`follow_open` of ``follower``; call it
        between two of its results (before the last ends the iteration)."""
        follower.add(job_ids)
        self.notices.extend(follower, job_ids)

    def _drive(self, follower: Follower, take: Callable[[], Iterable[T]]) -> Iterator[T]:
        """Yield what ``take`` finds until ``follower`` has nothing pending, woken by the
        client's :class:`~jobs.follow.NoticeHub` between polls."""
        woken = threading.Event()
        self.notices.add(follower, woken.set)
        try:
            while True:
                yield from take()
                if not follower.pending:
                    return
                if follower.expired():
                    raise TimeoutError(f"{len(follower.pending)} jobs not finished in time")
                woken.wait(follower.wait_s())
                woken.clear()  # what woke it is recorded on the follower, for take()
        finally:
            self.notices.remove(follower)
