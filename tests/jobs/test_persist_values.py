"""The result writer (``worker.persist.ResultWriter``) on real Redis and PostgreSQL: what it
stores, in which order it stores and acknowledges, what a database outage keeps, and the
fallbacks of a result the database refuses, checked on the stored values."""

from __future__ import annotations

import threading
import time

import redis
import sqlalchemy as sa
from services import all_roles_store, wait_until

from jobs.client import JobClient
from jobs.constants import CONSUMER_GROUP, Keys
from jobs.queue import Delivery, JobQueue
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome
from jobs.store import DeliveryStore
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.persist import ResultWriter
from worker.retry import RedisBackoff

SQL = all_roles_store()
MODEL = "tiny"


def _pending(client: redis.Redis, q: JobQueue) -> int:
    return sum(int(client.xpending(s, CONSUMER_GROUP)["pending"]) for s in q.streams
               if client.exists(s))


def _finished(metrics: WorkerMetrics, status: str) -> float:
    return metrics.registry.get_sample_value(
        "kvbatch_jobs_total", {"model_name": MODEL, "status": status}) or 0.0


class _Setup:
    def __init__(self, redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, n: int,
                 writer_id: str = "w1", after_commit=None) -> None:  # type: ignore[no-untyped-def]
        self.redis, self.keys = redis_client, keys
        self.client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
        self.specs = [JobSpec(model=MODEL, prompt=f"job {i}") for i in range(n)]
        self.client.submit(self.specs)
        self.q = JobQueue(redis_client, MODEL, keys)
        self.q.ensure_group()
        self.store = DeliveryStore(pg_engine)
        self.deliveries: dict[str, Delivery] = {
            d.job_id: d for d in self.q.read("w1", 100) if d.job_id is not None}
        self.store.begin_deliveries([s.id for s in self.specs], "w1", 3, time.time())
        self.metrics = WorkerMetrics(MODEL)
        self.writer = ResultWriter(self.store, writer_id, Outbox(self.q), RedisBackoff(),
                                   self.metrics, after_commit=after_commit)

    def pending(self) -> int:
        return _pending(self.redis, self.q)

    def info(self, job_id: str):  # type: ignore[no-untyped-def]
        (info,) = self.client.get_many([job_id])
        return info

    def notice(self, job_id: str) -> str | None:
        return self.redis.get(self.keys.done(job_id))


def _ok(job_id: str, text: str = "out", **kw) -> Outcome:  # type: ignore[no-untyped-def]
    return Outcome(job_id, JobStatus.SUCCEEDED, time.time(),
                   result=JobResult(text=text, token_ids=[1, 2], finish_reason="length"), **kw)


def test_outcomes_are_stored_with_their_values_then_acked_and_announced(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    seen: list[tuple[int, int, bool, list[str]]] = []

    def after_commit() -> None:  # stored, none acknowledged nor announced yet
        seen.append((s.pending(), len(s.writer), bool(s.writer),
                     [s.info(x.id).status.value for x in s.specs]))

    s = _Setup(redis_client, keys, pg_engine, 3, after_commit=after_commit)
    ok, failed, dup = s.specs
    # A duplicate: already terminal when this writer stores it (stored by another worker).
    s.store.finish([_ok(dup.id, "first")], worker_id="w0")
    s.writer.add(_ok(ok.id, "hello", stats=JobStats(prompt_tokens=7, generated_tokens=2)),
                 s.deliveries[ok.id])
    s.writer.add(Outcome(failed.id, JobStatus.FAILED, time.time(), error="boom"),
                 s.deliveries[failed.id])
    s.writer.add(_ok(dup.id, "second"), s.deliveries[dup.id])
    s.writer.add(_ok("0" * 32), None)  # no delivery (unknown job): nothing to ack
    assert len(s.writer) == 4 and s.writer
    s.writer.flush()
    assert seen == [(3, 4, True, ["succeeded", "failed", "succeeded"])]
    assert (s.pending(), len(s.writer), bool(s.writer)) == (0, 0, False)
    assert s.q.depth() == (0, 0)
    a, f, d = (s.info(x.id) for x in s.specs)
    assert (a.status, a.result.text, a.result.token_ids, a.worker_id, a.error) == (
        JobStatus.SUCCEEDED, "hello", [1, 2], "w1", None)
    assert (a.stats.prompt_tokens, a.stats.generated_tokens) == (7, 2)
    assert (f.status, f.error, f.worker_id) == (JobStatus.FAILED, "boom", "w1")
    assert (d.result.text, d.worker_id) == ("first", "w0")  # the first outcome stays
    assert (s.notice(ok.id), s.notice(failed.id), s.notice(dup.id)) == (
        "succeeded", "failed", None)
    assert (_finished(s.metrics, "succeeded"), _finished(s.metrics, "failed")) == (1, 1)


def test_a_database_outage_keeps_the_outcomes_unacked_and_in_order(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    calls: list[int] = []
    s = _Setup(redis_client, keys, pg_engine, 2, after_commit=lambda: calls.append(1))
    first, second = s.specs
    down = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none",
                            connect_args={"connect_timeout": 2})
    s.writer.store = DeliveryStore(down)
    s.writer.add(_ok(first.id, "one"), s.deliveries[first.id])
    now = time.time()
    s.writer.flush(now)
    s.writer.add(_ok(second.id, "two"), s.deliveries[second.id])
    assert (len(s.writer), bool(s.writer), s.pending(), calls) == (2, True, 2, [])
    assert [o.job_id for o, _ in s.writer._unsaved] == [first.id, second.id]
    assert not s.writer.backoff.ready(now) and s.writer.backoff.failures == 1
    assert s.info(first.id).status is JobStatus.RUNNING and not s.writer.outbox
    s.writer.store = DeliveryStore(pg_engine)
    s.writer.flush(now)  # still backing off: nothing tried
    assert (len(s.writer), s.pending()) == (2, 2)
    s.writer.flush(now + 60)
    assert (len(s.writer), bool(s.writer), s.pending(), calls) == (0, False, 0, [1])
    assert s.writer.backoff.failures == 0 and s.writer.backoff.ready(now)
    assert [s.info(x.id).result.text for x in s.specs] == ["one", "two"]
    down.dispose()


def test_a_refused_result_falls_back_to_a_failure_with_its_stats_then_to_a_bare_one(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 4)
    bad_result, bad_stats, good, first = s.specs
    finished_at = time.time() - 5
    # Stored one by one once the batch is refused: the first stored is not the last.
    s.writer.add(_ok(first.id, "first"), s.deliveries[first.id])
    # finish_reason's column holds 16 characters: the result is refused, its stats are not.
    long_reason = JobResult.model_construct(text="x", token_ids=[], finish_reason="r" * 40,
                                            logprobs=None, choices=[], embeddings=None)
    s.writer.add(Outcome(bad_result.id, JobStatus.SUCCEEDED, finished_at, result=long_reason,
                         stats=JobStats(prompt_tokens=5)), s.deliveries[bad_result.id])
    # prompt_tokens out of the integer column's range: refused with its stats too.
    s.writer.add(Outcome(bad_stats.id, JobStatus.SUCCEEDED, finished_at,
                         result=JobResult(text="y"), stats=JobStats(prompt_tokens=2**40)),
                 s.deliveries[bad_stats.id])
    s.writer.add(_ok(good.id, "fine", stats=JobStats(prompt_tokens=3)), s.deliveries[good.id])
    s.writer.flush()
    assert (len(s.writer), s.pending()) == (0, 0)
    r, st, g, f = (s.info(x.id) for x in s.specs)
    assert (f.status, f.result.text) == (JobStatus.SUCCEEDED, "first")
    assert (g.status, g.result.text, g.stats.prompt_tokens, g.worker_id) == (
        JobStatus.SUCCEEDED, "fine", 3, "w1")
    assert r.status is JobStatus.FAILED and r.error.startswith("could not store the result: ")
    assert (r.worker_id, r.stats.prompt_tokens) == ("w1", 5)
    assert r.finished_at is not None and abs(r.finished_at.timestamp() - finished_at) < 1e-3
    assert st.status is JobStatus.FAILED and st.error.startswith("could not store the result: ")
    assert st.stats.prompt_tokens == 0  # the bare failure: no stats
    # Each is announced with the status stored, and counted under it.
    assert [s.notice(x.id) for x in s.specs] == ["failed", "failed", "succeeded", "succeeded"]
    assert (_finished(s.metrics, "failed"), _finished(s.metrics, "succeeded")) == (2, 2)


def test_a_worker_id_the_database_refuses_is_dropped_from_the_bare_failure(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    # The writer's id is over the column's 128 characters: only the bare failure, which
    # leaves the worker id the delivery recorded, is stored.
    s = _Setup(redis_client, keys, pg_engine, 1, writer_id="w" * 200)
    (spec,) = s.specs
    s.writer.add(_ok(spec.id, stats=JobStats(prompt_tokens=4)), s.deliveries[spec.id])
    s.writer.flush()
    info = s.info(spec.id)
    assert (info.status, info.worker_id, info.stats.prompt_tokens) == (JobStatus.FAILED, "w1", 0)
    assert info.error.startswith("could not store the result: ")
    assert s.pending() == 0 and s.notice(spec.id) == "failed"


def _redis_down() -> None:
    raise redis.ConnectionError("down")


def test_the_writer_thread_stores_what_is_added_and_the_last_flush_what_is_left(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 2)
    first, second = s.specs
    s.writer.start()
    s.writer.add(_ok(first.id, "a"), s.deliveries[first.id])
    assert wait_until(lambda: s.pending() == 1 and not s.writer, 30, 0.02)
    s.writer.wait_stored(0.01)  # nothing being stored: returns
    assert s.writer.stop() and not s.writer._thread.is_alive()
    # Stopped: what is added now waits for the last flush, which ignores the backoffs.
    s.writer.add(_ok(second.id, "b"), s.deliveries[second.id])
    s.writer.backoff.failed(time.time())
    s.writer.redis_backoff.call(time.time(), _redis_down)
    assert not s.writer.redis_backoff.ready(time.time())
    assert len(s.writer) == 1 and s.info(second.id).status is JobStatus.RUNNING
    s.writer.last_flush()
    assert (len(s.writer), bool(s.writer), s.pending()) == (0, False, 0)
    assert [s.info(x.id).result.text for x in s.specs] == ["a", "b"]
    assert s.notice(second.id) == "succeeded"


def test_acks_redis_did_not_take_stay_owed(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 1)
    (spec,) = s.specs
    down = redis.Redis(host="127.0.0.1", port=1, decode_responses=True,
                       socket_connect_timeout=0.5)
    s.writer.outbox.queue = JobQueue(down, MODEL, keys)
    s.writer.add(_ok(spec.id), s.deliveries[spec.id])
    now = time.time() + 1000  # the writer paces its sends on the clock it is given
    s.writer.flush(now)
    assert s.info(spec.id).status is JobStatus.SUCCEEDED
    assert (len(s.writer), bool(s.writer), s.pending()) == (0, True, 1)
    assert not s.writer.redis_backoff.ready(now)
    s.writer.outbox.queue = s.q
    s.writer.flush(now + 60)
    assert (bool(s.writer), s.pending(), s.notice(spec.id)) == (False, 0, "succeeded")


def test_a_job_twice_in_one_transaction_is_stored_announced_and_counted_once(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 1)
    (spec,) = s.specs
    first = s.deliveries[spec.id]
    (copy_id,) = s.q.enqueue([spec])  # a second entry of it, delivered too
    (copy,) = s.q.read("w1", 10)
    assert copy.entry_id == copy_id
    s.writer.add(Outcome(spec.id, JobStatus.FAILED, time.time(), error="first"), first)
    s.writer.add(_ok(spec.id, "second"), copy)
    s.writer.flush()
    info = s.info(spec.id)
    assert (info.status, info.error) == (JobStatus.FAILED, "first")
    assert (s.pending(), s.notice(spec.id)) == (0, "failed")
    assert (_finished(s.metrics, "failed"), _finished(s.metrics, "succeeded")) == (1, 0)
    assert s.writer.outbox.done == [] and s.q.depth() == (0, 0)


def test_the_writer_thread_sends_acks_owed_once_redis_is_back_with_nothing_new_added(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 1)
    (spec,) = s.specs
    down = redis.Redis(host="127.0.0.1", port=1, decode_responses=True,
                       socket_connect_timeout=0.5)
    s.writer.outbox.queue = JobQueue(down, MODEL, keys)
    s.writer.start()
    try:
        s.writer.add(_ok(spec.id), s.deliveries[spec.id])
        assert wait_until(lambda: s.info(spec.id).status is JobStatus.SUCCEEDED, 30, 0.05)
        assert wait_until(lambda: not s.writer.redis_backoff.ready(time.time()), 30, 0.02)
        assert s.pending() == 1 and s.writer
        s.writer.outbox.queue = s.q  # Redis is back; the writer's own retries send the ack
        assert wait_until(lambda: s.pending() == 0 and not s.writer, 30, 0.05)
        assert s.notice(spec.id) == "succeeded"
    finally:
        assert s.writer.stop()


def test_wait_stored_waits_for_the_transaction_under_way(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    """The loop waits on the writer while its capacity is held by results being stored: a
    wait begun during the transaction ends with it, not before."""
    seen: list[int] = []

    def waiter() -> None:
        started.set()
        s.writer.wait_stored(30)
        seen.append(len(s.writer))

    started = threading.Event()
    thread = threading.Thread(target=waiter, daemon=True)

    def after_commit() -> None:  # the transaction is under way until this returns
        thread.start()
        started.wait(30)
        time.sleep(0.3)  # lets the waiter reach its wait

    s = _Setup(redis_client, keys, pg_engine, 1, after_commit=after_commit)
    (spec,) = s.specs
    s.writer.add(_ok(spec.id), s.deliveries[spec.id])
    s.writer.flush()
    thread.join(30)
    assert seen == [0]


def test_outcomes_added_during_a_failed_transaction_wait_behind_its_own(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 2)
    first, second = s.specs
    down = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none",
                            connect_args={"connect_timeout": 2})

    class AddsWhileStoring(DeliveryStore):  # the loop hands an outcome over meanwhile
        def finish(self, outcomes, worker_id=None):  # type: ignore[no-untyped-def]
            s.writer.add(_ok(second.id, "two"), s.deliveries[second.id])
            return super().finish(outcomes, worker_id=worker_id)

    s.writer.store = AddsWhileStoring(down)
    s.writer.add(_ok(first.id, "one"), s.deliveries[first.id])
    s.writer.flush()
    assert [o.job_id for o, _ in s.writer._unsaved] == [first.id, second.id]
    down.dispose()


def test_the_last_flush_waits_for_the_running_thread_then_stores_what_it_held_back(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine) -> None:
    s = _Setup(redis_client, keys, pg_engine, 1)
    (spec,) = s.specs
    s.writer.backoff.failed(time.time() + 1000)  # the thread leaves it: backing off
    s.writer.start()
    s.writer.add(_ok(spec.id, "kept"), s.deliveries[spec.id])
    s.writer.last_flush()
    assert not s.writer._thread.is_alive()
    assert (len(s.writer), s.pending(), s.info(spec.id).result.text) == (0, 0, "kept")
