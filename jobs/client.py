"""The producer side: submit jobs, read them back, cancel them, wait for them."""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import redis
from sqlalchemy import Engine

from jobs.constants import DEFAULT_KEY_PREFIX, Keys
from jobs.db import DEFAULT_DATABASE_URL, make_engine
from jobs.queue import JobQueue, signal_cancel
from jobs.schemas import JobInfo, JobSpec, JobStatus, encode_job
from jobs.store import JobStore

log = logging.getLogger(__name__)


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
        redis_url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        self.redis = redis_client or redis.Redis.from_url(redis_url, decode_responses=True)
        self.keys = Keys(key_prefix)
        self.store = JobStore(make_engine(database) if isinstance(database, str) else database)

    def submit(self, specs: Sequence[JobSpec]) -> list[str]:
        """Record ``specs`` as queued (one SQL transaction), then add them to their streams.

        Once this returns the jobs are durable: if the XADD fails, the reconciler enqueues
        them later. Raises ``ValueError`` for a payload over the size limit and SQLAlchemy's
        ``IntegrityError`` for a duplicate id or (batch_id, custom_id).
        """
        for spec in specs:
            encode_job(spec)  # size check before anything is stored
        self.store.insert_jobs(specs)
        by_model: dict[str, list[JobSpec]] = defaultdict(list)
        for spec in specs:
            by_model[spec.model].append(spec)
        for model, group in by_model.items():
            queue = JobQueue(self.redis, model, self.keys)
            try:
                queue.ensure_group()
                queue.enqueue(group)
            except redis.RedisError as exc:
                log.warning("jobs stored but not enqueued (%s); the reconciler will", exc)
        return [s.id for s in specs]

    def get(self, job_id: str) -> JobInfo | None:
        return self.store.get(job_id)

    def get_many(self, job_ids: Sequence[str]) -> list[JobInfo]:
        return self.store.get_many(job_ids)

    def cancel(self, job_id: str) -> JobStatus | None:
        """Cancel a job: a queued one at once, a running one by its worker (which aborts it
        in the engine). Returns the status right after the request; None if unknown."""
        status = self.store.request_cancel(job_id, time.time())
        if status is JobStatus.RUNNING:
            signal_cancel(self.redis, self.keys, job_id)
        elif status is JobStatus.CANCELLED:
            self.redis.set(self.keys.done(job_id), status.value)
        return status

    def wait(self, job_ids: Sequence[str], timeout_s: float = 60.0,
             poll_interval_s: float = 1.0) -> list[JobInfo]:
        """Block until all ``job_ids`` are terminal (or ``timeout_s`` passes); return them."""
        waiting = set(job_ids)
        deadline = time.monotonic() + timeout_s
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.keys.done_channel())
        try:
            next_poll = 0.0
            while waiting and time.monotonic() < deadline:
                if time.monotonic() >= next_poll:
                    infos = self.store.get_many(sorted(waiting))
                    waiting -= {i.id for i in infos if i.status.terminal}
                    next_poll = time.monotonic() + poll_interval_s
                msg = pubsub.get_message(timeout=min(poll_interval_s, 0.2))
                if msg and msg.get("type") == "message":
                    waiting.discard(json.loads(msg["data"]).get("id"))
        finally:
            pubsub.close()
        return self.store.get_many(list(job_ids))
