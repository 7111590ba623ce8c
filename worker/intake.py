"""A worker's intake: deliveries from the stream up to the engine's door.

:meth:`Intake.pull` reads what the worker has room for (its own pending entries after a
restart, orphans of dead workers, new entries) and parses each one: a malformed job, a job of
another model, one over a limit (``jobs.limits``) or a second copy is settled at once and
never reaches the engine.
:meth:`Intake.decide` counts the deliveries in SQL (``DeliveryStore.begin_deliveries``) and
returns the jobs to run; the others are acknowledged, dead-lettered or announced here.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection

from sqlalchemy.exc import SQLAlchemyError

from engine.lora_config import adapter_of
from jobs.limits import JobLimits
from jobs.queue import Delivery, EntryRef, JobQueue
from jobs.route import ROUTE_BUCKETS, owned_buckets
from jobs.schemas import JOB_ID_PATTERN, JobSpec, JobStatus, Outcome, decode_job
from jobs.store import Decision, DeliveryStore
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.persist import ResultWriter
from worker.retry import Backoff, is_outage, short_error

log = logging.getLogger(__name__)

IDLE_BLOCK_MS = 100
ROUTE_REFRESH_S = 1.0  # how often a worker recomputes the buckets it owns


class Intake:
    """Deliveries not yet decided, and how to pull and decide them."""

    def __init__(self, queue: JobQueue, deliveries: DeliveryStore, results: ResultWriter,
                 outbox: Outbox, metrics: WorkerMetrics, limits: JobLimits, *, worker_id: str,
                 model_name: str, max_deliveries: int, lease_ttl_s: float,
                 affinity: bool = True, adapters: tuple[str, ...] = ()) -> None:
        self.queue, self.deliveries, self.limits = queue, deliveries, limits
        self.results, self.outbox, self.metrics = results, outbox, metrics
        self.worker_id, self.model_name = worker_id, model_name
        self.max_deliveries, self.lease_ttl_s = max_deliveries, lease_ttl_s
        self.affinity = affinity
        self.adapters = adapters  # the LoRA adapters' names (jobs name <model>:<adapter>)
        self.undecided: list[tuple[Delivery, JobSpec]] = []
        self._own_backlog: list[EntryRef] = []  # entries pending on our name from a past process
        self.owned: list[int] = list(range(ROUTE_BUCKETS))  # the buckets read first
        self._others: list[int] = []  # the buckets stolen from when ours are empty
        self._route_at = 0.0
        self._live: set[str] = set()  # live workers as of the last pull
        self._backoff = Backoff()
        self._claim_at = 0.0

    def __len__(self) -> int:
        return len(self.undecided)

    def take_back_own(self) -> None:
        """After a restart under the same worker id: the entries its previous process held
        (``XREADGROUP >`` never returns them again), pulled before anything new."""
        self._own_backlog = self.queue.own_pending(self.worker_id)
        if self._own_backlog:
            log.info("taking back %d jobs left pending under %s", len(self._own_backlog),
                     self.worker_id)

    def pull(self, now: float, count: int, held: Collection[str], idle: bool) -> int:
        """Pull up to ``count`` deliveries and parse them: our own pending entries after a
        restart, orphans of dead workers, then new entries of the buckets we own, then, while
        room is left, stolen from the other buckets; when nothing came and ``idle``, block
        briefly for our buckets. ``held`` are the jobs already in the engine (a second copy
        of one is acked). Returns how many were pulled."""
        if count <= 0:
            return 0
        deliveries: list[Delivery] = []
        if self._own_backlog:
            ids, self._own_backlog = self._own_backlog[:count], self._own_backlog[count:]
            deliveries = self.queue.claim(self.worker_id, ids)[0]
        if now >= self._claim_at and len(deliveries) < count:
            deliveries += self.queue.claim_orphans(self.worker_id, count - len(deliveries),
                                                   min_idle_ms=int(self.lease_ttl_s * 500))
            self._claim_at = now + self.lease_ttl_s / 3
        self._route(now)
        deliveries += self.queue.read(self.worker_id, count - len(deliveries), self.owned)
        deliveries += self.queue.read(self.worker_id, count - len(deliveries), self._others,
                                      steal=True)
        if not deliveries and idle:
            deliveries = self.queue.wait(self.worker_id, IDLE_BLOCK_MS, self.owned)
            # XREADGROUP hands out one entry a stream: what exceeds the room stays pending on
            # this worker and is taken back first by the next pull, as after a restart.
            deliveries, extra = deliveries[:count], deliveries[count:]
            self._own_backlog += [(d.stream, d.entry_id) for d in extra]
        if deliveries:
            self._live = self.queue.live_workers()
            self._accept(deliveries, held)
        return len(deliveries)

    def _route(self, now: float) -> None:
        """Recompute which buckets are ours (``jobs.route``): a worker that joined or died
        moves buckets within :data:`ROUTE_REFRESH_S` of its heartbeat appearing or lapsing."""
        if not self.affinity or now < self._route_at:
            return
        own = set(owned_buckets(self.worker_id, self.queue.serving()))
        self.owned = sorted(own)
        self._others = [b for b in range(ROUTE_BUCKETS) if b not in own]
        self._route_at = now + ROUTE_REFRESH_S

    def _accept(self, deliveries: list[Delivery], held: Collection[str]) -> None:
        now = time.time()
        seen = {spec.id for _, spec in self.undecided} | set(held)
        for d in deliveries:
            try:
                spec = decode_job(d.payload or "")
                if spec.id != d.job_id:
                    raise ValueError(f"entry id field {d.job_id!r} != job id {spec.id!r}")
            except Exception as exc:  # whatever a payload makes the parser raise, it fails alone
                reason = f"malformed job message: {short_error(exc)}"
                if d.job_id and _valid_id(d.job_id):
                    self.results.add(Outcome(d.job_id, JobStatus.FAILED, now, error=reason), d)
                else:
                    self._dead_letter(d, reason)
                    log.warning("dead-lettered an unreadable message (%s)", d.entry_id)
                continue
            error = self._refusal(spec)
            if error is not None:
                self.results.add(Outcome(spec.id, JobStatus.FAILED, now, error=error), d)
            elif spec.id in seen:  # a second copy (e.g. re-enqueued); the first one runs
                self.outbox.ack([d])
            else:
                seen.add(spec.id)
                self.undecided.append((d, spec))

    def _dead_letter(self, d: Delivery, reason: str) -> None:
        self.outbox.dead_letter(d, reason)
        self.metrics.dead_lettered.inc()

    def _refusal(self, spec: JobSpec) -> str | None:
        """Why ``spec`` never reaches the engine (checked here, off the engine thread)."""
        if spec.model != self.model_name:
            try:
                adapter_of(spec.model, self.model_name, self.adapters)
            except ValueError:
                also = f" and its LoRA adapters {', '.join(self.adapters)}" if self.adapters else ""
                return (f"unknown model {spec.model!r}: this queue is served by "
                        f"{self.model_name!r}{also}")
            if spec.embed is not None:
                return (f"embedding jobs run on the base model ({self.model_name!r}), not a "
                        f"LoRA adapter ({spec.model!r})")
        try:
            self.limits.check(spec)
        except Exception as exc:  # a job that breaks a check fails alone
            return short_error(exc)
        return None

    def decide(self, now: float) -> list[tuple[Delivery, JobSpec]]:
        """Count the deliveries in SQL and act on each job's :class:`Decision`; return the
        jobs decided RUN (none while the database is unavailable: retried with backoff)."""
        if not self.undecided or not self._backoff.ready(now):
            return []
        batch = self.undecided
        try:
            decisions = self.deliveries.begin_deliveries(
                [spec.id for _, spec in batch], self.worker_id, self.max_deliveries, now,
                live_workers=self._live)
        except SQLAlchemyError as exc:
            self._backoff.failed(now)
            log.log(logging.WARNING if is_outage(exc) else logging.ERROR,
                    "could not record %d deliveries (%s); retrying", len(batch),
                    short_error(exc))
            return []
        self._backoff.ok()
        self.undecided = []
        run: list[tuple[Delivery, JobSpec]] = []
        dead_reason = f"delivered more than {self.max_deliveries} times"
        for d, spec in batch:
            decision = decisions[spec.id]
            if decision is Decision.RUN:
                run.append((d, spec))
                continue
            if decision is Decision.DEAD:
                self._dead_letter(d, dead_reason)
            else:
                self.outbox.ack([d])
            if decision.status is not None:
                self.outbox.notify(spec.id, decision.status.value)
                self.metrics.job_finished(decision.status.value)
        return run


def _valid_id(job_id: str) -> bool:
    return re.fullmatch(JOB_ID_PATTERN.strip("^$"), job_id) is not None
