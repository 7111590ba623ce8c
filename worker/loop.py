"""The worker loop: pull jobs from the stream, feed the engine, persist results.

One pass of :meth:`Worker.tick` is a visible pipeline::

    pull (Redis: cancels; then ``worker.intake``: own pending after a restart, orphans, new
    entries up to the free capacity from the buckets it owns, then stolen from others') →
    decide (``worker.intake``, SQL: count the delivery, skip duplicates, dead-letter,
    expire) → admit (the engine: ``worker.engine_process``) →
    collect outputs → hand them to the result writer → flush the outbox (acks and dead
    letters of jobs settled at intake)

The result writer (``worker/persist.py``) stores finished jobs on a thread of its own (one SQL
transaction for what gathered, then XACK and completion notices), so the next pass pulls
while the last results are written. Other I/O happens on this thread, except the lease
(``worker/heartbeat.py``) and the queue's upkeep (``worker/maintenance.py``: feeding the
stream from the SQL backlog, reconciling), which have their own threads so a slow pass never
costs the worker its jobs. A failing database or Redis only delays work: undecided
deliveries, unsaved results and owed Redis writes are retried with backoff, and nothing is
acknowledged before it is stored.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from sqlalchemy import Engine as Database
from sqlalchemy.exc import SQLAlchemyError

from engine.lora_config import adapter_of
from jobs.constants import Keys
from jobs.db import make_engine
from jobs.feed import Feeder
from jobs.limits import JobLimits
from jobs.queue import Delivery, JobQueue
from jobs.schemas import JobSpec, JobStatus, Outcome
from jobs.store import DeliveryStore, FeedStore, MaintenanceStore
from worker.cpu_share import CpuShare
from worker.engine_process import EngineProcess
from worker.engine_thread import Engine, EngineRunner, EngineThread
from worker.heartbeat import Heartbeat
from worker.intake import Intake
from worker.maintenance import UpkeepThread
from worker.messages import Abort, Add, Crashed, Embed, Rejected, Stepped, Threads
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.outcome import engine_outcome
from worker.persist import ResultWriter
from worker.retry import RedisBackoff, short_error
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from engine.outputs import EngineStats, RequestOutput

log = logging.getLogger(__name__)

CANCEL_POLL_INTERVAL_S = 1.0
DEPTH_INTERVAL_S = 1.0
# Redis calls give up after this long (XREADGROUP blocks intake.IDLE_BLOCK_MS at most).
REDIS_SOCKET_TIMEOUT_S = 5.0
REDIS_CONNECT_TIMEOUT_S = 5.0
# Database calls give up after these; a pass of the loop is then bounded by a few of them.
SQL_CONNECT_TIMEOUT_S = 5.0
SQL_STATEMENT_TIMEOUT_S = 30.0
# A loop with no progress for this long is stuck: its lease lapses so others take its jobs.
LOOP_STALL_S = 120.0


@dataclass
class Held:
    """A job this worker admitted to its engine."""

    delivery: Delivery
    spec: JobSpec
    admitted_at: float  # time.time() when sent to the runner
    abort_as: JobStatus | None = None  # set when we aborted it: CANCELLED or EXPIRED
    tokens_seen: int = 0
    last_token_s: float | None = None  # time.monotonic() of the last new token

    @property
    def deadline_s(self) -> float | None:
        return self.spec.deadline.timestamp() if self.spec.deadline else None


class Worker:
    """Runs one engine for ``settings.model_name`` until :meth:`stop`.

    Args:
        settings: the worker's settings.
        llm: the engine: an :class:`~worker.engine_process.EngineProcess` (the engine in a
            child process, as ``kvbatch worker`` runs it), or an engine object (an
            ``engine.LLMEngine``, a test's wrapper) run on a thread of this process, which from
            now on alone uses it. Either way the loop drives it through its :attr:`runner`.
        redis_client: optional client (``decode_responses=True``); else from ``redis_url``.
        db: optional SQLAlchemy ``Engine`` (the database); else from ``database_url``.
        after_commit: passed to the result writer (:class:`~worker.persist.ResultWriter`).
    """

    def __init__(self, settings: WorkerSettings, llm: Engine | EngineProcess, *,
                 redis_client: redis.Redis | None = None,
                 db: Database | None = None,
                 after_commit: Callable[[], None] | None = None) -> None:
        self.settings = s = settings
        self.worker_id = s.worker_id
        # encoding_errors="replace": a stream entry that is not UTF-8 must reach the decision
        # step as a malformed job, not raise while the reply is parsed (killing the loop).
        self.redis = redis_client or redis.Redis.from_url(
            s.redis_url, decode_responses=True, encoding_errors="replace",
            socket_timeout=REDIS_SOCKET_TIMEOUT_S, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
        self.db = db or make_engine(
            s.database_url, connect_timeout_s=SQL_CONNECT_TIMEOUT_S,
            statement_timeout_s=SQL_STATEMENT_TIMEOUT_S)
        self.deliveries = DeliveryStore(self.db)
        self.keys = Keys(s.key_prefix)
        self.queue = JobQueue(self.redis, s.model_name, self.keys)
        self.metrics = WorkerMetrics(s.model_name)
        self.runner: EngineRunner = llm if isinstance(llm, EngineProcess) else EngineThread(llm)
        self.engine_stats: EngineStats | None = None
        self.held: dict[str, Held] = {}
        self.outbox = Outbox(self.queue)
        self.redis_backoff = RedisBackoff()
        self.results = ResultWriter(self.deliveries, self.worker_id, self.outbox,
                                    self.redis_backoff, self.metrics, after_commit=after_commit)
        cpus = self.runner.host_cpus  # 0: its threads are not for the worker to split
        self.cpu_share = CpuShare(self.redis, self.keys, self.worker_id, cpus) if cpus else None
        self.heartbeat = Heartbeat(self.queue, self.worker_id, s.lease_ttl_s, LOOP_STALL_S,
                                   s.window, s.served_adapters,
                                   self.cpu_share.host if self.cpu_share else None)
        self.upkeep = UpkeepThread(Feeder(self.queue, FeedStore(self.db)),
                                   MaintenanceStore(self.db), s.reconcile_interval_s,
                                   s.reconcile_grace_s, self.metrics)
        self.limits = JobLimits()
        self.intake = Intake(self.queue, self.deliveries, self.results, self.outbox,
                             self.metrics, self.limits, worker_id=self.worker_id,
                             model_name=s.model_name, max_deliveries=s.max_deliveries,
                             lease_ttl_s=s.lease_ttl_s, affinity=s.affinity,
                             adapters=s.adapters)
        self._cancels_at = self._depth_at = 0.0
        self._stop = threading.Event()
        self._drain_until: float | None = None
        self._no_drain = False
        self._pubsub: Any = None

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
        self.intake.take_back_own()
        self.heartbeat.start()
        self.upkeep.start()
        self.runner.start()
        self.results.start()
        log.info("worker %s serving %s", self.worker_id, self.settings.model_name)
        try:
            while True:
                if self._no_drain:
                    self._drain_until = 0.0
                if self._stop.is_set() and self._drain_until is None:
                    self._drain_until = time.time() + self.settings.drain_timeout_s
                    self.upkeep.stop()
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
        return bool(self.held or self.intake or self.results or self.outbox)

    def _close(self) -> None:
        self.results.last_flush()  # acks still owed (Redis was down) get one more try
        self.upkeep.stop()
        self.heartbeat.stop()
        self.runner.stop()
        with contextlib.suppress(redis.RedisError):
            if self._pubsub is not None:
                self._pubsub.close()
            self.queue.drop_heartbeat(self.worker_id)

    # -- one pass ----------------------------------------------------------------------------

    def tick(self) -> bool:
        """One pass of the loop; False if the engine crashed."""
        now = time.time()
        self.heartbeat.progress()
        self.redis_backoff.call(now, lambda: self._pull_pass(now))
        self._decide(now)
        self._expire_overdue(now)
        poll_s = self.settings.poll_interval_ms / 1000
        if not self._collect(wait_s=poll_s if self.held else 0):
            return False
        if not self.held and self.results and not self.free_capacity():
            self.results.wait_stored(poll_s)  # the pull waits on the writer: no busy loop
        self.redis_backoff.call(time.time(), self.outbox.flush)
        return True

    def _pull_pass(self, now: float) -> None:
        self._check_cancels(now)
        if self.cpu_share is not None and self.engine_stats is not None and (
                threads := self.cpu_share.update(now, self.engine_stats.cpu_threads)):
            self.runner.commands.put(Threads(threads))
        if not self.draining:
            idle = not self.held  # the writer stores results on its own thread meanwhile
            if self.intake.pull(now, self.free_capacity(), self.held, idle):
                self.upkeep.wake()  # the stream is moving: refill the window soon
        if now >= self._depth_at:
            waiting, _ = self.queue.depth()
            self.metrics.queue_depth.set(waiting)
            self.metrics.in_flight.set(len(self.held))
            self._depth_at = now + DEPTH_INTERVAL_S

    # -- pull and decide ---------------------------------------------------------------------

    def free_capacity(self) -> int:
        """How many more jobs to hold: the engine's slots plus a small waiting buffer."""
        s = self.settings
        # Unsaved results still hold their stream entries: a database outage stops the pull.
        free = s.capacity - len(self.held) - len(self.intake) - len(self.results)
        if self.engine_stats is not None and self.engine_stats.num_waiting > s.waiting_buffer:
            return 0  # the engine cannot admit what it has (KV pressure)
        return max(free, 0)

    def _decide(self, now: float) -> None:
        for d, spec in self.intake.decide(now):
            self._admit(d, spec)

    def _admit(self, d: Delivery, spec: JobSpec) -> None:
        # spec.sampling (spec.embed.pooling) is the engine's SamplingParams (PoolingParams),
        # validated when the job was decoded.
        self.held[spec.id] = Held(d, spec, admitted_at=time.time())
        if spec.embed is not None:
            self.runner.commands.put(
                Embed(spec.id, spec.embed.input, spec.embed.pooling, spec.priority))
            return
        lora = adapter_of(spec.model, self.intake.model_name, self.intake.adapters)  # checked
        self.runner.commands.put(
            Add(spec.id, spec.engine_prompt(chat=self.runner.has_chat_template), spec.sampling,
                spec.priority, lora))

    # -- cancellation and deadlines ----------------------------------------------------------

    def _check_cancels(self, now: float) -> None:
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(self.keys.cancel_channel())
        while (msg := self._pubsub.get_message(timeout=0)) is not None:
            if msg.get("type") == "message":
                self._abort(msg["data"], JobStatus.CANCELLED)
        if now >= self._cancels_at and self.held:  # messages can be missed; keys cannot
            for job_id in self.queue.cancel_requested(list(self.held)):
                self._abort(job_id, JobStatus.CANCELLED)
            self._cancels_at = now + CANCEL_POLL_INTERVAL_S

    def _expire_overdue(self, now: float) -> None:
        for job_id, h in self.held.items():
            if h.abort_as is None and h.deadline_s is not None and h.deadline_s <= now:
                self._abort(job_id, JobStatus.EXPIRED)

    def _abort(self, job_id: str, status: JobStatus) -> None:
        h = self.held.get(job_id)
        if h is not None and h.abort_as is None:
            h.abort_as = status
            self.runner.commands.put(Abort(job_id))

    # -- outputs -----------------------------------------------------------------------------

    def _collect(self, wait_s: float) -> bool:
        try:
            events = self.runner.events
            event = events.get(timeout=wait_s) if wait_s else events.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(event, Crashed):
                log.error("engine crashed; giving jobs back: %s", event.error)
                return False
            if isinstance(event, Rejected):
                h = self.held.pop(event.job_id, None)
                if h is not None:
                    self.results.add(Outcome(event.job_id, JobStatus.FAILED, time.time(),
                                             error=f"rejected: {event.error}"), h.delivery)
            elif isinstance(event, Stepped):
                self._on_step(event)
            try:
                event = events.get_nowait()
            except queue.Empty:
                return True

    def _on_step(self, ev: Stepped) -> None:
        self.engine_stats = ev.stats
        self.metrics.observe_engine(ev.stats)
        for job_id, n_tokens in ev.progress.items():
            if (h := self.held.get(job_id)) is not None:
                self._observe_tokens(h, n_tokens, ev.time_s)
        for out in ev.finished:
            h = self.held.pop(out.request_id, None)
            if h is None:
                continue  # handed back already
            self._observe_tokens(h, max((len(c.token_ids) for c in out.outputs), default=0),
                                 ev.time_s)
            self.results.add(self._outcome(h, out, ev.token_bytes), h.delivery)

    def _observe_tokens(self, h: Held, n_tokens: int, time_s: float) -> None:
        new = n_tokens - h.tokens_seen
        if new > 0:
            if h.last_token_s is not None:
                gap = (time_s - h.last_token_s) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            h.tokens_seen, h.last_token_s = n_tokens, time_s

    def _outcome(self, h: Held, out: RequestOutput, token_bytes: dict[int, bytes]) -> Outcome:
        outcome = engine_outcome(out, h.spec, h.admitted_at, h.abort_as,
                                 token_bytes,
                                 self.limits.max_result_bytes)
        stats = outcome.stats
        assert stats is not None
        for value, hist in ((stats.queue_wait_s, self.metrics.queue_time),
                            (stats.ttft_s, self.metrics.ttft), (stats.e2e_s, self.metrics.e2e)):
            if value is not None:
                hist.observe(value)
        return outcome

    # -- giving jobs back --------------------------------------------------------------------

    def _hand_back(self, count_attempt: bool = False) -> None:
        """Give unfinished jobs back: first store what already finished (a graceful stop must
        not throw results away), then abort the rest in the engine, mark them queued (without
        counting the attempt, unless we crashed), and end our lease so live workers claim
        their stream entries now."""
        if not count_attempt:
            self._collect(wait_s=0)
        self.results.last_flush()
        self.redis_backoff.reset()  # the outbox once more: the writer may have been too busy
        self.redis_backoff.call(time.time(), self.outbox.flush)
        ids = list(self.held)
        for job_id in ids:
            self.runner.commands.put(Abort(job_id))
        self.held.clear()
        if ids and not count_attempt:
            try:
                self.deliveries.release(ids, self.worker_id)
            except SQLAlchemyError as exc:
                log.warning("could not release %d jobs in SQL: %s", len(ids), short_error(exc))
        log.info("handed back %d jobs (%d results unsaved)", len(ids) + len(self.intake),
                 len(self.results))
        self.heartbeat.stop()
        with contextlib.suppress(redis.RedisError):
            self.queue.drop_heartbeat(self.worker_id)

