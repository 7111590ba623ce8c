"""The asyncio twin of :mod:`jobs.sdk`: the same calls, awaitable.

Waiting goes through the sync client's :class:`~jobs.follow.NoticeHub`: one done-channel
subscription and one batched SQL poll per client, whatever the number of concurrent waiters
(each is woken on the event loop when one of its jobs ends). SQL reads and submissions run the
sync client's code in a worker thread (``asyncio.to_thread``), so both clients share one
implementation of every rule (validation, idempotent batches, completion order).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from jobs.constants import DEFAULT_MODEL, EMBED_TEXTS_PER_JOB
from jobs.follow import Follower
from jobs.rows import Row
from jobs.schemas import JobInfo, JobResult, JobStatus
from jobs.sdk import (
    BatchCounts,
    BatchHandle,
    Client,
    JobHandle,
    embedding_specs,
    embedding_vectors,
    result_of,
)
from jobs.settings import connection_settings
from jobs.stats import Stats

T = TypeVar("T")


class AsyncJobHandle:
    """A submitted job (see :class:`jobs.sdk.JobHandle`)."""

    def __init__(self, client: AsyncClient, job_id: str) -> None:
        self.client = client
        self.id = job_id
        self._sync = JobHandle(client.jobs, job_id)

    def __repr__(self) -> str:
        return f"AsyncJobHandle({self.id!r})"

    async def info(self) -> JobInfo:
        """The stored job (status, result, statistics)."""
        return await asyncio.to_thread(self._sync.info)

    async def status(self) -> JobStatus:
        """The job's current status."""
        return (await self.info()).status

    async def wait(self, timeout_s: float | None = None) -> JobInfo:
        """Wait until the job is terminal.

        Args:
            timeout_s: raise ``TimeoutError`` after this long (None: wait forever).
        """
        async for info in self.client.follow([self.id], timeout_s):
            return info
        raise AssertionError("follow() ended without the job")  # pragma: no cover

    async def result(self, timeout_s: float | None = None) -> JobResult:
        """Wait for the job and return its result.

        Args:
            timeout_s: raise ``TimeoutError`` after this long (None: wait forever).

        Raises:
            JobFailed: the job failed, was cancelled or expired; carries the stored reason.
        """
        return result_of(await self.wait(timeout_s))

    async def cancel(self) -> JobStatus | None:
        """Cancel the job; returns the status right after the request."""
        return await asyncio.to_thread(self._sync.cancel)


class AsyncBatchHandle:
    """A submitted batch (see :class:`jobs.sdk.BatchHandle`)."""

    def __init__(self, client: AsyncClient, sync: BatchHandle) -> None:
        self.client = client
        self.id = sync.id
        self._sync = sync

    def __repr__(self) -> str:
        return f"AsyncBatchHandle({self.id!r})"

    async def job_ids(self) -> dict[str, str]:
        """``custom_id`` -> job id of every row."""
        return await asyncio.to_thread(lambda: self._sync.job_ids)

    async def counts(self) -> BatchCounts:
        """How many of the batch's jobs are in each status, now."""
        return await asyncio.to_thread(self._sync.counts)

    async def results(self, timeout_s: float | None = None,
                      poll_interval_s: float = 1.0) -> AsyncIterator[JobInfo]:
        """Yield every job of the batch once terminal, in completion order.

        Args:
            timeout_s: raise ``TimeoutError`` if the batch is not done by then.
            poll_interval_s: how often SQL is read when no completion notice arrives.
        """
        job_ids = await self.job_ids()
        async for info in self.client.follow(list(job_ids.values()), timeout_s,
                                             poll_interval_s, batch_id=self.id):
            yield info

    async def wait(self, timeout_s: float | None = None) -> BatchCounts:
        """Wait until every job of the batch is terminal; return the final counts.

        Args:
            timeout_s: raise ``TimeoutError`` after this long.
        """
        job_ids = await self.job_ids()
        await self.client.wait_terminal(list(job_ids.values()), timeout_s, batch_id=self.id)
        return await self.counts()

    async def cancel(self) -> int:
        """Cancel every unfinished job of the batch; return how many were asked to stop."""
        return await asyncio.to_thread(self._sync.cancel)

    async def stats(self) -> Stats:
        """Aggregate statistics of the batch's finished jobs (from SQL)."""
        return await asyncio.to_thread(self._sync.stats)


class AsyncClient:
    """Submit jobs and await their results (see :class:`jobs.sdk.Client`).

    Args:
        redis_url: the queue (default ``$KVBATCH_REDIS_URL``, else local Redis).
        database_url: the SQL database (default ``$KVBATCH_DATABASE_URL``, else SQLite).
        key_prefix: Redis key prefix shared with the workers.
        model: served model name used when a call names none.
    """

    def __init__(self, redis_url: str | None = None, database_url: str | None = None, *,
                 key_prefix: str | None = None, model: str = DEFAULT_MODEL) -> None:
        conn = connection_settings(redis_url, database_url, key_prefix)
        self.sync = Client(conn.redis_url, conn.database_url, key_prefix=conn.key_prefix,
                           model=model)
        self.jobs = self.sync.jobs  # what the sync twin's calls run on, in worker threads

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the Redis and database connections."""
        await asyncio.to_thread(self.sync.close)

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> AsyncJobHandle:
        """Submit one job.

        Args:
            prompt: the request as text (one user message on a chat model); or pass
                ``raw_prompt=`` (text as it is) or ``messages=``.
            **kwargs: as :meth:`jobs.sdk.Client.submit` (``messages``, ``model``,
                ``max_tokens``, ``temperature``, ``priority``, ``metadata``, ``deadline``,
                other sampling fields).

        Raises:
            pydantic.ValidationError: invalid arguments; nothing was enqueued.
        """
        handle = await asyncio.to_thread(functools.partial(self.sync.submit, prompt, **kwargs))
        return AsyncJobHandle(self, handle.id)

    async def embed(self, texts: Sequence[str], *, model: str | None = None,
                    dimensions: int | None = None, priority: int = 0,
                    texts_per_job: int = EMBED_TEXTS_PER_JOB,
                    timeout_s: float | None = None) -> list[list[float]]:
        """Embed ``texts``; their vectors, in order. The arguments and errors are
        :meth:`jobs.sdk.Client.embed`'s."""
        specs = embedding_specs(texts, model=model or self.sync.model, dimensions=dimensions,
                                priority=priority, texts_per_job=texts_per_job)
        await asyncio.to_thread(self.jobs.submit, specs)
        ids = [spec.id for spec in specs]
        return embedding_vectors(ids, {info.id: info async for info in self.follow(ids, timeout_s)})

    async def submit_batch(self, rows: Iterable[Mapping[str, Any] | Row],
                           **kwargs: Any) -> AsyncBatchHandle:
        """Submit many rows as one batch, streamed in chunks (in a thread); ``custom_id`` is
        the idempotency key.

        Args:
            rows: plain or OpenAI Batch API rows, any iterable (read in a thread).
            **kwargs: as :meth:`jobs.sdk.Client.submit_batch` (``batch_id``, ``model``,
                ``system_prompt``, ``priority``, ``deadline``, ``webhook_url``, sampling
                defaults).

        Raises:
            ValueError: a malformed row; nothing of its chunk or after was enqueued.
        """
        handle = await asyncio.to_thread(functools.partial(self.sync.submit_batch, rows,
                                                           **kwargs))
        return AsyncBatchHandle(self, handle)

    async def job(self, job_id: str) -> AsyncJobHandle:
        """A handle on an existing job (``KeyError`` if unknown).

        Args:
            job_id: the job's id.
        """
        await asyncio.to_thread(self.sync.job, job_id)
        return AsyncJobHandle(self, job_id)

    async def batch(self, batch_id: str) -> AsyncBatchHandle:
        """A handle on an existing batch (``KeyError`` if it has no jobs).

        Args:
            batch_id: the batch's id.
        """
        return AsyncBatchHandle(self, await asyncio.to_thread(self.sync.batch, batch_id))

    async def stats(self, batch_id: str | None = None,
                    since: datetime | timedelta | None = None) -> Stats:
        """Aggregate statistics of finished jobs, from SQL.

        Args:
            batch_id: only this batch.
            since: only jobs finished since then (a ``timedelta`` counts back from now).
        """
        return await asyncio.to_thread(self.sync.stats, batch_id, since)

    async def follow(self, job_ids: Collection[str], timeout_s: float | None = None,
                     poll_interval_s: float = 1.0,
                     batch_id: str | None = None) -> AsyncIterator[JobInfo]:
        """Yield each of ``job_ids`` once it is terminal, in completion order.

        Args:
            job_ids: the jobs to follow.
            timeout_s: raise ``TimeoutError`` if they are not all terminal by then.
            poll_interval_s: how often SQL is read when no completion notice arrives.
            batch_id: pass it when ``job_ids`` are the whole batch (cheaper polls).
        """
        follower = self.jobs.follower(job_ids, timeout_s, poll_interval_s, batch_id)
        async for info in self._drive(follower, follower.take):
            yield info

    async def wait_terminal(self, job_ids: Collection[str], timeout_s: float | None = None,
                            poll_interval_s: float = 1.0, batch_id: str | None = None) -> None:
        """Wait until all ``job_ids`` are terminal, reading their ids and statuses only (no
        results); the arguments are :meth:`follow`'s. Raises ``TimeoutError``."""
        follower = self.jobs.follower(job_ids, timeout_s, poll_interval_s, batch_id)
        async for _ in self._drive(follower, follower.take_ids):
            pass

    async def _drive(self, follower: Follower,
                     take: Callable[[], Iterable[T]]) -> AsyncIterator[T]:
        """Yield what ``take`` finds (on a thread: it reads SQL) until ``follower`` has
        nothing pending, woken by the client's notice hub between polls."""
        loop = asyncio.get_running_loop()
        noticed = asyncio.Event()
        self.jobs.notices.add(follower, lambda: loop.call_soon_threadsafe(noticed.set))
        try:
            while True:
                for item in await asyncio.to_thread(take):
                    yield item
                if not follower.pending:
                    return
                if follower.expired():
                    raise TimeoutError(f"{len(follower.pending)} jobs not finished in time")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(noticed.wait(), follower.wait_s())
                noticed.clear()
        finally:
            self.jobs.notices.remove(follower)

