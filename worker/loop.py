"""The worker loop: pull jobs from the stream, feed the engine thread, persist results.

One pass of :meth:`Worker.tick` is a visible pipeline::

    heartbeat → pull (claim orphans, XREADGROUP COUNT=free capacity) → decide (SQL: count the
    delivery, skip duplicates, dead-letter, expire) → admit (engine thread) → collect outputs →
    persist (one SQL transaction) → XACK → publish completions

All Redis and SQL I/O happens here, never on the engine thread. A failing database or Redis
only delays work: undecided deliveries and unsaved results are retried with backoff and not
acknowledged until stored.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import Engine
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from jobs.constants import Keys
from jobs.db import make_engine
from jobs.queue import Delivery, JobQueue
from jobs.reconcile import reconcile
from jobs.schemas import JOB_ID_PATTERN, JobSpec, JobStatus
from jobs.schemas import decode_job as _decode
from jobs.store import Decision, JobStore, Outcome
from worker.engine_thread import Abort, Add, Crashed, EngineThread, Rejected, Stepped
from worker.metrics import WorkerMetrics
from worker.outcome import engine_outcome
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

CANCEL_POLL_INTERVAL_S = 1.0
DEPTH_INTERVAL_S = 1.0
MAX_BACKOFF_S = 10.0
IDLE_BLOCK_MS = 100


@dataclass
class Held:
    """A job this worker admitted to its engine."""

    delivery: Delivery
    spec: JobSpec
    admitted_at: float  # time.time() when sent to the engine thread
    abort_as: JobStatus | None = None  # set when we aborted it: CANCELLED or EXPIRED
    tokens_seen: int = 0
    last_token_s: float | None = None  # time.monotonic() of the last new token

    @property
    def deadline_s(self) -> float | None:
        return self.spec.deadline.timestamp() if self.spec.deadline else None


@dataclass
class _Backoff:
    failures: int = 0
    retry_at: float = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.retry_at

    def failed(self, now: float) -> None:
        self.failures += 1
        self.retry_at = now + min(MAX_BACKOFF_S, 0.1 * 2 ** self.failures)

    def ok(self) -> None:
        self.failures, self.retry_at = 0, 0.0


@dataclass
class _Timers:
    heartbeat: float = 0.0
    claim: float = 0.0
    cancels: float = 0.0
    depth: float = 0.0
    reconcile: float = field(default_factory=time.time)


class Worker:
    """Runs one engine for ``settings.model_name`` until :meth:`stop`.

    Args:
        settings: the worker's settings.
        engine: an ``engine.LLMEngine``; from now on only the worker's engine thread uses it.
        redis_client: optional client (``decode_responses=True``); else from ``redis_url``.
        sql_engine: optional SQLAlchemy engine; else from ``database_url``.
    """

    def __init__(self, settings: WorkerSettings, engine: Any, *,
                 redis_client: redis.Redis | None = None,
                 sql_engine: Engine | None = None) -> None:
        self.settings = s = settings
        self.worker_id = s.worker_id
        self.redis = redis_client or redis.Redis.from_url(
            s.redis_url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
        self.store = JobStore(sql_engine or make_engine(s.database_url))
        self.keys = Keys(s.key_prefix)
        self.queue = JobQueue(self.redis, s.model_name, self.keys)
        self.metrics = WorkerMetrics(s.model_name)
        self.engine = EngineThread(engine)
        self.engine_stats: Any = None
        self.held: dict[str, Held] = {}
        self._undecided: list[tuple[Delivery, JobSpec]] = []
        self._unsaved: list[tuple[Outcome, Delivery | None]] = []
        self._unacked: list[str] = []
        self._decide_backoff = _Backoff()
        self._save_backoff = _Backoff()
        self._redis_backoff = _Backoff()
        self._timers = _Timers()
        self._stop = threading.Event()
        self._drain_until: float | None = None
        self._no_drain = False
        self._pubsub: Any = None
        self.lease_ttl_ms = int(s.lease_ttl_s * 1000)

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self, drain: bool = True) -> None:
        """Ask for a graceful stop: pull nothing more, finish in-flight jobs for up to
        ``drain_timeout_s`` (none with ``drain=False``), hand the rest back. Safe to call from
        a signal handler or another thread."""
        if not drain:
            self._no_drain = True
        self._stop.set()

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def run(self) -> int:
        """Work until stopped; returns the process exit code (1 if the engine crashed)."""
        self.queue.ensure_group()
        self.queue.heartbeat(self.worker_id, self.lease_ttl_ms)
        self.engine.start()
        log.info("worker %s serving %s", self.worker_id, self.settings.model_name)
        try:
            while True:
                if self._no_drain:
                    self._drain_until = 0.0
                if self._stop.is_set() and self._drain_until is None:
                    self._drain_until = time.time() + self.settings.drain_timeout_s
                    log.info("draining %d jobs (up to %.0fs)", len(self.held),
                             self.settings.drain_timeout_s)
                if self.draining and not self._busy():
                    break
                if self.draining and time.time() >= self._drain_until:
                    self._hand_back()
                    break
                if not self.tick():
                    self._hand_back(count_attempt=True)
                    return 1
            return 0
        finally:
            self._close()

    def _busy(self) -> bool:
        return bool(self.held or self._undecided or self._unsaved or self._unacked)

    def _close(self) -> None:
        self.engine.stop()
        with contextlib.suppress(redis.RedisError):
            if self._pubsub is not None:
                self._pubsub.close()
            self.queue.drop_heartbeat(self.worker_id)

    # -- one pass ----------------------------------------------------------------------------

    def tick(self) -> bool:
        """One pass of the loop; False if the engine crashed."""
        now = time.time()
        try:
            if self._redis_backoff.ready(now):
                self._redis_io(now)
                self._redis_backoff.ok()
        except redis.RedisError as exc:
            self._redis_backoff.failed(now)
            log.warning("redis unavailable (%s); retrying in %.1fs", exc,
                        self._redis_backoff.retry_at - now)
        self._expire_overdue(now)
        if not self._collect(wait_s=self.settings.poll_interval_ms / 1000 if self.held else 0):
            return False
        self._persist()
        return True

    def _redis_io(self, now: float) -> None:
        t = self._timers
        if now >= t.heartbeat:
            self.queue.heartbeat(self.worker_id, self.lease_ttl_ms)
            t.heartbeat = now + self.settings.lease_ttl_s / 3
        if self._unacked:
            self.queue.ack(self._unacked)
            self._unacked = []
        self._check_cancels(now)
        if not self.draining:
            self._pull(now)
        self._decide()
        if now >= t.depth:
            waiting, _ = self.queue.depth()
            self.metrics.queue_depth.set(waiting)
            self.metrics.in_flight.set(len(self.held))
            t.depth = now + DEPTH_INTERVAL_S
        if now >= t.reconcile and not self.draining:
            t.reconcile = now + self.settings.reconcile_interval_s
            self._reconcile()

    # -- pull and decide ---------------------------------------------------------------------

    def free_capacity(self) -> int:
        """How many more jobs to hold: the engine's slots plus a small waiting buffer."""
        s = self.settings
        # Unsaved results still hold their stream entries: a database outage stops the pull.
        free = s.capacity - len(self.held) - len(self._undecided) - len(self._unsaved)
        if self.engine_stats is not None and self.engine_stats.num_waiting > s.waiting_buffer:
            return 0  # the engine cannot admit what it has (KV pressure)
        return max(free, 0)

    def _pull(self, now: float) -> None:
        count = self.free_capacity()
        if count <= 0:
            return
        deliveries: list[Delivery] = []
        if now >= self._timers.claim:
            deliveries = self.queue.claim_orphans(self.worker_id, count,
                                                  min_idle_ms=self.lease_ttl_ms // 2)
            self._timers.claim = now + self.settings.lease_ttl_s / 3
        idle = not self.held and not self._unsaved and not deliveries
        deliveries += self.queue.read(self.worker_id, count - len(deliveries),
                                      block_ms=IDLE_BLOCK_MS if idle else None)
        if deliveries:
            self._accept(deliveries)

    def _accept(self, deliveries: list[Delivery]) -> None:
        now = time.time()
        dead: list[tuple[Delivery, str]] = []
        seen = {spec.id for _, spec in self._undecided} | set(self.held)
        for d in deliveries:
            try:
                spec = _decode(d.payload or "")
                if spec.id != d.job_id:
                    raise ValueError(f"entry id field {d.job_id!r} != job id {spec.id!r}")
            except ValueError as exc:
                reason = f"malformed job message: {_short(exc)}"
                if d.job_id and _valid_id(d.job_id):
                    self._unsaved.append((Outcome(d.job_id, JobStatus.FAILED, now,
                                                  error=reason), d))
                else:
                    dead.append((d, reason))
                continue
            if spec.model != self.settings.model_name:
                error = (f"unknown model {spec.model!r}: this queue is served by "
                         f"{self.settings.model_name!r}")
                self._unsaved.append((Outcome(spec.id, JobStatus.FAILED, now, error=error), d))
            elif spec.id in seen:  # a second copy (e.g. re-enqueued); the first one runs
                self._unacked.append(d.entry_id)
            else:
                seen.add(spec.id)
                self._undecided.append((d, spec))
        if dead:
            self.queue.dead_letter([d for d, _ in dead], [r for _, r in dead])
            log.warning("dead-lettered %d unreadable messages", len(dead))

    def _decide(self) -> None:
        """Count the deliveries in SQL and act on each job's :class:`Decision`."""
        now = time.time()
        if not self._undecided or not self._decide_backoff.ready(now):
            return
        batch = self._undecided
        try:
            decisions = self.store.begin_deliveries(
                [spec.id for _, spec in batch], self.worker_id,
                self.settings.max_deliveries, now)
        except SQLAlchemyError as exc:
            self._decide_backoff.failed(now)
            log.warning("database unavailable (%s); holding %d deliveries", _short(exc),
                        len(batch))
            return
        self._decide_backoff.ok()
        self._undecided = []
        ack: list[str] = []
        dead: list[Delivery] = []
        done: list[tuple[str, str]] = []
        for d, spec in batch:
            decision = decisions[spec.id]
            if decision is Decision.RUN:
                self._admit(d, spec)
                continue
            if decision is Decision.DEAD:
                dead.append(d)
            else:
                ack.append(d.entry_id)
            if decision is not Decision.SKIP:
                done.append((spec.id, _DECISION_STATUS[decision].value))
                self.metrics.job_finished(_DECISION_STATUS[decision].value)
        if dead:
            self.queue.dead_letter(
                dead, [f"delivered more than {self.settings.max_deliveries} times"] * len(dead))
        self._unacked += ack
        if done:
            self.queue.publish_done(done)

    def _admit(self, d: Delivery, spec: JobSpec) -> None:
        from engine import SamplingParams

        try:
            params = SamplingParams(**spec.sampling.model_dump())
        except (ValueError, TypeError) as exc:
            self._unsaved.append((Outcome(spec.id, JobStatus.FAILED, time.time(),
                                          error=f"invalid sampling parameters: {exc}"), d))
            return
        self.held[spec.id] = Held(d, spec, admitted_at=time.time())
        self.engine.commands.put(Add(spec.id, spec.engine_prompt(), params, spec.priority))

    # -- cancellation and deadlines ----------------------------------------------------------

    def _check_cancels(self, now: float) -> None:
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(self.keys.cancel_channel())
        while (msg := self._pubsub.get_message(timeout=0)) is not None:
            if msg.get("type") == "message":
                self._abort(msg["data"], JobStatus.CANCELLED)
        if now >= self._timers.cancels and self.held:  # messages can be missed; keys cannot
            for job_id in self.queue.cancel_requested(list(self.held)):
                self._abort(job_id, JobStatus.CANCELLED)
            self._timers.cancels = now + CANCEL_POLL_INTERVAL_S

    def _expire_overdue(self, now: float) -> None:
        for job_id, h in self.held.items():
            if h.abort_as is None and h.deadline_s is not None and h.deadline_s <= now:
                self._abort(job_id, JobStatus.EXPIRED)

    def _abort(self, job_id: str, status: JobStatus) -> None:
        h = self.held.get(job_id)
        if h is not None and h.abort_as is None:
            h.abort_as = status
            self.engine.commands.put(Abort(job_id))

    # -- outputs -----------------------------------------------------------------------------

    def _collect(self, wait_s: float) -> bool:
        try:
            event = self.engine.events.get(timeout=wait_s) if wait_s else \
                self.engine.events.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(event, Crashed):
                log.error("engine crashed; giving jobs back: %s", event.error)
                return False
            if isinstance(event, Rejected):
                h = self.held.pop(event.job_id, None)
                if h is not None:
                    self._unsaved.append((Outcome(event.job_id, JobStatus.FAILED, time.time(),
                                                  error=f"rejected: {event.error}"), h.delivery))
            elif isinstance(event, Stepped):
                self._on_step(event)
            try:
                event = self.engine.events.get_nowait()
            except queue.Empty:
                return True

    def _on_step(self, ev: Stepped) -> None:
        self.engine_stats = ev.stats
        self.metrics.observe_engine(ev.stats)
        for out in ev.outputs:
            h = self.held.get(out.request_id)
            if h is None:
                continue  # handed back already
            n_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            new = n_tokens - h.tokens_seen
            if new > 0:
                if h.last_token_s is not None:
                    gap = (ev.time_s - h.last_token_s) / new
                    for _ in range(new):
                        self.metrics.itl.observe(gap)
                h.tokens_seen, h.last_token_s = n_tokens, ev.time_s
            if out.finished:
                del self.held[out.request_id]
                self._unsaved.append((self._outcome(h, out), h.delivery))

    def _outcome(self, h: Held, out: Any) -> Outcome:
        outcome = engine_outcome(out, h.spec, h.admitted_at, h.abort_as)
        stats = outcome.stats
        assert stats is not None
        for value, hist in ((stats.queue_wait_s, self.metrics.queue_time),
                            (stats.ttft_s, self.metrics.ttft), (stats.e2e_s, self.metrics.e2e)):
            if value is not None:
                hist.observe(value)
        return outcome

    # -- persistence -------------------------------------------------------------------------

    def _persist(self) -> None:
        """Store finished jobs in one transaction, then ack them, then tell waiters."""
        now = time.time()
        if not self._unsaved or not self._save_backoff.ready(now):
            return
        batch = self._unsaved
        try:
            newly = self.store.finish([o for o, _ in batch], worker_id=self.worker_id)
        except (OperationalError, InterfaceError) as exc:
            self._save_backoff.failed(now)
            log.warning("database unavailable (%s); %d results wait, unacked", _short(exc),
                        len(batch))
            return
        except SQLAlchemyError as exc:  # maybe one result the database refuses: isolate it
            newly = self._persist_one_by_one(batch, exc)
            if newly is None:
                return
        self._save_backoff.ok()
        self._unsaved = self._unsaved[len(batch):]
        self._unacked += [d.entry_id for _, d in batch if d is not None]
        done = [(o.job_id, o.status.value) for o, _ in batch if o.job_id in newly]
        for _, status in done:
            self.metrics.job_finished(status)
        try:
            self.queue.ack(self._unacked)
            self._unacked = []
            self.queue.publish_done(done)
        except redis.RedisError as exc:  # acks are retried next tick; waiters also poll SQL
            log.warning("ack/publish failed (%s)", exc)

    def _persist_one_by_one(self, batch: list[tuple[Outcome, Delivery | None]],
                            batch_error: SQLAlchemyError) -> set[str] | None:
        """Store outcomes singly; one the database rejects is stored as a failure carrying
        the reason. None (retry later) if even that fails: then it is an outage after all."""
        newly: set[str] = set()
        try:
            for outcome, _ in batch:
                try:
                    newly |= self.store.finish([outcome], worker_id=self.worker_id)
                except (OperationalError, InterfaceError):
                    raise
                except SQLAlchemyError as exc:
                    log.error("result of job %s rejected by the database: %s", outcome.job_id,
                              _short(exc))
                    failed = Outcome(outcome.job_id, JobStatus.FAILED, outcome.finished_at,
                                     error=f"could not store the result: {_short(exc)}",
                                     stats=outcome.stats)
                    newly |= self.store.finish([failed], worker_id=self.worker_id)
        except SQLAlchemyError as exc:
            self._save_backoff.failed(time.time())
            log.warning("database unavailable (%s / %s); %d results wait, unacked",
                        _short(batch_error), _short(exc), len(batch))
            return None
        return newly

    # -- maintenance -------------------------------------------------------------------------

    def _reconcile(self) -> None:
        s = self.settings
        lock = self.redis.set(self.keys.reconcile_lock(s.model_name), self.worker_id, nx=True,
                              px=int(s.reconcile_interval_s * 1000))
        if not lock:
            return
        try:
            report = reconcile(self.store, self.queue, s.reconcile_grace_s)
        except SQLAlchemyError as exc:
            log.warning("reconciler skipped: %s", _short(exc))
            return
        for _ in report.expired:
            self.metrics.job_finished(JobStatus.EXPIRED.value)

    def _hand_back(self, count_attempt: bool = False) -> None:
        """Give unfinished jobs back: abort them in the engine, mark them queued (without
        counting the attempt, unless we crashed), and end our lease so live workers claim
        their stream entries now."""
        ids = list(self.held)
        for job_id in ids:
            self.engine.commands.put(Abort(job_id))
        self.held.clear()
        if ids and not count_attempt:
            try:
                self.store.release(ids, self.worker_id)
            except SQLAlchemyError as exc:
                log.warning("could not release %d jobs in SQL: %s", len(ids), _short(exc))
        log.info("handed back %d jobs", len(ids) + len(self._undecided))
        with contextlib.suppress(redis.RedisError):
            self.queue.drop_heartbeat(self.worker_id)


_DECISION_STATUS = {
    Decision.DEAD: JobStatus.FAILED,
    Decision.EXPIRED: JobStatus.EXPIRED,
    Decision.CANCELLED: JobStatus.CANCELLED,
    Decision.SKIP: JobStatus.SUCCEEDED,  # unused: skips publish nothing
}


def _valid_id(job_id: str) -> bool:
    return re.fullmatch(JOB_ID_PATTERN.strip("^$"), job_id) is not None


def _short(exc: BaseException, limit: int = 500) -> str:
    text = str(exc).strip().splitlines()
    line = " ".join(text[:3]) if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."

