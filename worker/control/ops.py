"""The bodies of the control-plane tasks, plain functions of :class:`Services` and the time.

Each is idempotent: state changes are guarded by the rows' current state (terminal job
transitions by ``status IN ('queued', 'running')``, batch steps by the batch's columns), so a
task that runs twice, or on two control replicas at once, does its work once.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import Engine

from jobs.constants import DONE_MARKER_TTL_S, FIELD_ID, FIELD_JOB, FIELD_REASON, Keys
from jobs.db import make_engine
from jobs.lease import Lease
from jobs.queue import DEAD_LETTER_MAXLEN, JobQueue, announce_ended
from jobs.schemas import JobStatus, encode_job
from jobs.store import BatchStore, JobReader, MaintenanceStore
from worker.control import batches
from worker.control.settings import ControlSettings
from worker.control.webhook import backoff_s, post_event

log = logging.getLogger(__name__)
DAY_S = 86400.0


@dataclass
class Services:
    """Connections shared by the tasks of one control process (all thread-safe)."""

    settings: ControlSettings
    db: Engine
    redis: redis.Redis
    keys: Keys
    webhook_slots: threading.BoundedSemaphore  # POSTs in flight, at most webhook_concurrency

    @classmethod
    def connect(cls, settings: ControlSettings) -> Services:
        return cls(settings, make_engine(settings.database_url),
                   redis.Redis.from_url(settings.redis_url, decode_responses=True),
                   Keys(settings.key_prefix),
                   threading.BoundedSemaphore(settings.webhook_concurrency))

    def lease(self, name: str) -> Lease:
        """The lease of task ``name`` (``jobs.lease``): one run at a time across replicas;
        the tasks are idempotent, so a stalled holder needs no fencing."""
        return Lease(self.redis, self.keys.control_lock(name), self.settings.task_lock_ttl_s)

    @property
    def maintenance(self) -> MaintenanceStore:
        return MaintenanceStore(self.db)

    @property
    def batches(self) -> BatchStore:
        return BatchStore(self.db)

    @property
    def reader(self) -> JobReader:
        return JobReader(self.db)

    def close(self) -> None:
        self.db.dispose()
        self.redis.close()

    def publish_done(self, jobs: list[tuple[str, str]]) -> None:
        if jobs:  # the channel is shared by all models; the queue's model does not matter
            JobQueue(self.redis, "", self.keys).publish_done(jobs)


def expire_deadlines(svc: Services, now_s: float) -> dict[str, Any]:
    """Expire batches past their deadline (with their active jobs), then any job past its own.
    Running jobs expired here get a cancel signal, so a live worker frees their KV blocks."""
    s = svc.settings
    by_batch = svc.batches.expire_batches(now_s, s.page_size)
    jobs = [job for expired in by_batch.values() for job in expired]
    while page := svc.maintenance.expire_past_deadline(
            now_s, running_grace_s=s.running_deadline_grace_s, limit=s.page_size):
        jobs += page
        if len(page) < s.page_size:
            break
    announce_ended(svc.redis, svc.keys, JobStatus.EXPIRED, jobs)
    if jobs or by_batch:
        log.info("expired %d batches and %d jobs", len(by_batch), len(jobs))
    return {"batches": sorted(by_batch), "jobs": sorted(job_id for job_id, _ in jobs)}


def complete_batches(svc: Services, now_s: float) -> list[str]:
    """Mark finished batches ``completed``; returns the batches now due for finalizing."""
    done = svc.batches.complete_batches(now_s, svc.settings.batch_settle_s)
    if done:
        log.info("batches completed: %s", ", ".join(done))
    return svc.batches.due_batches(now_s)


def finalize_batch(svc: Services, batch_id: str, now_s: float) -> str:
    """Export, publish, POST: what is left of finalizing one settled batch. Returns what
    happened: ``skipped`` (not settled, already finalized, or retry not due), ``notified``,
    ``retry`` (export or webhook failed, will be retried), ``busy`` (every webhook slot in use:
    a later pass POSTs it) or ``gave-up``.

    Every failed attempt, of the export or of the POST, is counted in ``webhook_attempts``
    and retried with backoff. Once ``webhook_max_attempts`` are used, an export that still fails
    is left out (the event says ``results_path: null``, ``webhook_error`` says why) and a
    webhook that still fails is given up."""
    s = svc.settings
    batch = svc.batches.load(batch_id)
    if batch is None or not batch.status.ended or batch.notified_at is not None:
        return "skipped"
    if batch.webhook_next_at is not None and batch.webhook_next_at.timestamp() > now_s:
        return "skipped"
    attempt = batch.webhook_attempts + 1
    retry_in_s = backoff_s(attempt, s.webhook_backoff_s)
    results_path, export_error = batch.results_path, None
    if s.export_dir and results_path is None:
        try:
            results_path = batches.export_results(svc.reader, batch_id, s.export_dir)
        except Exception as exc:  # disk full, permissions: count the attempt, retry
            export_error = f"export failed: {type(exc).__name__}: {exc}"
            log.warning("batch %s attempt %d: %s", batch_id, attempt, export_error)
            if attempt < s.webhook_max_attempts:
                svc.batches.record_webhook_attempt(batch_id, now_s, export_error,
                                               s.webhook_max_attempts, retry_in_s)
                return "retry"
        else:
            svc.batches.record_export(batch_id, results_path)
    event = batches.event(svc.reader, batch, results_path)
    # Published once: the marker key is set only by the first run that gets this far.
    if svc.redis.set(svc.keys.batch_done(batch_id), batch.status.value, nx=True,
                     ex=DONE_MARKER_TTL_S):
        svc.redis.publish(svc.keys.batch_done_channel(), json.dumps(event))
    url = batch.webhook_url or s.webhook_url
    if not url:
        if export_error is not None:
            svc.batches.record_webhook_attempt(batch_id, now_s, export_error, 1, 0.0)
            return "gave-up"
        svc.batches.mark_notified(batch_id, now_s)
        return "notified"
    # At most webhook_concurrency POSTs at once: slow receivers never hold every control
    # thread (expiry, reaping and purge run on the others). A batch that finds no slot is
    # finalized on a later pass, its attempt not counted.
    if not svc.webhook_slots.acquire(blocking=False):
        return "busy"
    try:
        error = post_event(url, event, s.webhook_secret, s.webhook_timeout_s,
                           allow=s.webhook_networks, allow_unsigned=s.webhook_allow_unsigned)
    finally:
        svc.webhook_slots.release()
    settled = svc.batches.record_webhook_attempt(batch_id, now_s,
                                             error or export_error, s.webhook_max_attempts,
                                             retry_in_s, delivered=error is None)
    if error is None:
        return "gave-up" if export_error else "notified"
    log.warning("batch %s webhook attempt %d failed: %s", batch_id, attempt, error)
    return "gave-up" if settled else "retry"


def purge(svc: Services, now_s: float) -> dict[str, int]:
    """Drop old result payloads, then (if configured) old job rows, a chunk per transaction."""
    s = svc.settings
    purged = deleted = 0
    if s.results_retention_days is not None:
        cutoff = now_s - s.results_retention_days * DAY_S
        while (n := svc.maintenance.purge_results(cutoff, s.purge_chunk)) > 0:
            purged += n
    if s.jobs_retention_days is not None:
        cutoff = now_s - s.jobs_retention_days * DAY_S
        while (n := svc.maintenance.delete_finished(cutoff, s.purge_chunk)) > 0:
            deleted += n
    if purged or deleted:
        log.info("retention: dropped %d results, deleted %d jobs", purged, deleted)
    return {"results_purged": purged, "jobs_deleted": deleted}


def reap(svc: Services, now_s: float) -> list[str]:
    """Fail jobs past the delivery limit that no live worker holds, and copy them to their
    model's dead-letter stream, as a worker would on their next delivery."""
    queue = JobQueue(svc.redis, "", svc.keys)  # the worker registry spans all models
    reaped: list[tuple[str, str, int]] = []
    after: str | None = ""
    while after is not None:
        page, after = svc.maintenance.reap_overdelivered(svc.settings.max_deliveries,
                                                   queue.live_workers, now_s,
                                                   svc.settings.page_size, after)
        reaped += page
    if not reaped:
        return []
    specs = {spec.id: spec
             for spec in svc.maintenance.specs([job_id for job_id, _, _ in reaped])[0]}
    by_model: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for job_id, model, attempts in reaped:
        by_model[model].append((job_id, attempts))
    pipe = svc.redis.pipeline(transaction=False)
    for model, jobs in by_model.items():
        for job_id, attempts in jobs:
            spec = specs.get(job_id)
            pipe.xadd(svc.keys.dead_letter(model), {
                FIELD_ID: job_id, FIELD_JOB: encode_job(spec) if spec else "",
                FIELD_REASON: f"reaped after {attempts} deliveries",
            }, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    pipe.execute()
    svc.publish_done([(job_id, JobStatus.FAILED.value) for job_id, _, _ in reaped])
    log.warning("reaped %d jobs past %d deliveries", len(reaped), svc.settings.max_deliveries)
    return [job_id for job_id, _, _ in reaped]
