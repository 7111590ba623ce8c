"""The reconciler: SQL is the system of record, so whatever SQL says is queued or running must be
in the stream or held by a live worker. Jobs that are neither (Redis lost its data, a producer
died between its SQL commit and its XADD) are enqueued again; queued jobs past their deadline
are expired."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from jobs.queue import JobQueue
from jobs.schemas import JobStatus
from jobs.store import MaintenanceStore

log = logging.getLogger(__name__)
PAGE_SIZE = 1000


@dataclass(frozen=True)
class ReconcileReport:
    expired: list[str]
    requeued: list[str]


def reconcile(store: MaintenanceStore, queue: JobQueue, grace_s: float,
              now_s: float | None = None) -> ReconcileReport:
    """One pass for ``queue.model``. Jobs created less than ``grace_s`` ago (by the database's
    clock) are left alone: their producer may not have reached its XADD yet. Active jobs are
    read one page at a time, so a large backlog never sits in memory as rows."""
    now_s = time.time() if now_s is None else now_s
    expired: list[str] = []
    while page := store.expire_past_deadline(now_s, model=queue.model, limit=PAGE_SIZE):
        expired += [job_id for job_id, _ in page]
        if len(page) < PAGE_SIZE:
            break
    if expired:
        queue.publish_done((job_id, JobStatus.EXPIRED.value) for job_id in expired)
    in_stream: set[str] | None = None
    live: set[str] = set()
    requeued: list[str] = []
    for page in store.active_jobs(queue.model, older_than_s=grace_s, page_size=PAGE_SIZE):
        if in_stream is None:  # only read Redis when SQL has candidates
            in_stream, live = queue.job_ids_in_stream(), queue.live_workers()
        missing = [
            job_id for job_id, status, worker_id in page
            if job_id not in in_stream and not (status == JobStatus.RUNNING and worker_id in live)
        ]
        if missing:
            specs, invalid = store.specs(missing)
            queue.enqueue(specs)
            requeued += [spec.id for spec in specs]
            # Stored by an older kvbatch and refused by today's rules: they fail, with why.
            failed = store.fail({job_id: f"stored job no longer valid: {reason}"
                                 for job_id, reason in invalid.items()}, now_s)
            if failed:
                queue.publish_done((job_id, JobStatus.FAILED.value) for job_id in failed)
                log.warning("reconciler failed %d stored %s jobs that no longer validate",
                            len(failed), queue.model)
    if requeued:
        log.warning("reconciler re-enqueued %d %s jobs missing from Redis", len(requeued),
                    queue.model)
    return ReconcileReport(expired, requeued)
