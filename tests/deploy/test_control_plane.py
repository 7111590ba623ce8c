"""The Celery control-plane tasks, run eagerly (and once through a real worker thread) against
the real Redis and a migrated PostgreSQL / SQLite database; each test asserts the rows."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from services import all_roles_store, jsonl, wait_until
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from jobs.constants import Keys
from jobs.models import Batch, Job, JobMetrics
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome
from jobs.store import to_dt
from worker.control import ops
from worker.control.app import make_app
from worker.control.settings import ControlSettings

SQL = all_roles_store()

MODEL = "m"
DAY_S = 86400.0


def settings_for(keys: Keys, database_url: str, **overrides: Any) -> ControlSettings:
    from services import REDIS_URL

    values: dict[str, Any] = {"redis_url": REDIS_URL, "database_url": database_url,
                              "key_prefix": keys.prefix, "batch_settle_s": 0.0,
                              "webhook_timeout_s": 5.0, "webhook_backoff_s": 30.0,
                              # the receivers listen on loopback, which webhooks may not reach
                              # unless allowed; events are signed unless allowed otherwise
                              "webhook_allow_networks": "127.0.0.0/8",
                              "webhook_allow_unsigned": True}
    values.update(overrides)
    return ControlSettings(**values)


@pytest.fixture
def control(keys: Keys, sql_engine: Engine) -> Iterator:  # type: ignore[type-arg]
    """``control(**settings)``: an eager control app on the test's Redis prefix and database."""
    apps = []

    def make(**overrides: Any):  # type: ignore[no-untyped-def]
        app = make_app(settings_for(keys, str(sql_engine.url.render_as_string(False)),
                                    **overrides))
        app.conf.update(task_always_eager=True, task_eager_propagates=True)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.kvbatch_services.close()


def task(app, name: str) -> Any:  # type: ignore[no-untyped-def]
    return app.tasks[f"kvbatch.control.{name}"]


def submit(store: SQL, n: int, batch_id: str | None = None, prefix: str = "j",
           deadline: datetime | None = None, submitted_at: float | None = None) -> list[str]:
    specs = [JobSpec(id=f"{prefix}{i}", batch_id=batch_id, custom_id=f"row-{i}", model=MODEL,
                     prompt=f"prompt {i}", deadline=deadline,
                     submitted_at=submitted_at or time.time() - 60)
             for i in range(n)]
    store.insert_jobs(specs)
    return [s.id for s in specs]


def succeed(store: SQL, job_id: str, finished_at: float | None = None) -> None:
    result = JobResult(text=f"answer {job_id}", token_ids=[1, 2, 3], finish_reason="stop")
    stats = JobStats(e2e_s=0.5, prompt_tokens=4, generated_tokens=3)
    store.finish([Outcome(job_id, JobStatus.SUCCEEDED, finished_at or time.time(),
                          result=result, stats=stats)])


def rows(engine: Engine, *ids: str) -> dict[str, Job]:
    with Session(engine) as session:
        return {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(ids)))}


def batch_row(engine: Engine, batch_id: str) -> Batch:
    with Session(engine) as session:
        b = session.get(Batch, batch_id)
        assert b is not None
        session.expunge(b)
        return b


# -- deadlines ---------------------------------------------------------------------------------

def test_expire_deadlines_expires_batches_and_jobs_once(control, sql_engine: Engine,
                                                        redis_client: redis.Redis,
                                                        keys: Keys) -> None:
    app = control(running_deadline_grace_s=60.0)
    store = SQL(sql_engine)
    now = time.time()
    past = datetime.now(UTC) - timedelta(seconds=10)
    long_past = datetime.now(UTC) - timedelta(seconds=600)
    # A batch past its own deadline: queued, running and finished jobs.
    b_ids = submit(store, 3, batch_id="b1", prefix="b1-")
    SQL(sql_engine).configure_batch("b1", deadline=to_dt(now - 1))
    store.begin_deliveries(["b1-1"], "w1", max_deliveries=3, now_s=now)
    succeed(store, "b1-2")
    # A batch whose deadline is still ahead is left alone.
    submit(store, 1, batch_id="b2", prefix="b2-")
    SQL(sql_engine).configure_batch("b2", deadline=to_dt(now + 3600))
    # Jobs past their own deadline: queued, running beyond the grace, running within it.
    submit(store, 1, prefix="q-", deadline=past)
    submit(store, 1, prefix="late-", deadline=long_past)
    submit(store, 1, prefix="fresh-", deadline=past)
    store.begin_deliveries(["late-0", "fresh-0"], "w1", max_deliveries=3, now_s=now - 700)

    report = task(app, "expire_deadlines").delay().get()

    assert report == {"batches": ["b1"], "jobs": ["b1-0", "b1-1", "late-0", "q-0"]}
    got = rows(sql_engine, *b_ids, "b2-0", "q-0", "late-0", "fresh-0")
    assert {k: v.status for k, v in got.items()} == {
        "b1-0": "expired", "b1-1": "expired", "b1-2": "succeeded", "b2-0": "queued",
        "q-0": "expired", "late-0": "expired", "fresh-0": "running",
    }
    assert got["b1-0"].error == "batch deadline passed"
    assert "while running" in (got["late-0"].error or "")
    assert batch_row(sql_engine, "b1").status == "expired"
    assert batch_row(sql_engine, "b2").status == "in_progress"
    with Session(sql_engine) as session:  # exactly one metrics row per terminal job
        assert len(session.scalars(select(JobMetrics.job_id)).all()) == 5
    # Running jobs are told to stop; every expired job is announced to waiters.
    assert redis_client.exists(keys.cancel("b1-1"), keys.cancel("late-0")) == 2
    assert not redis_client.exists(keys.cancel("b1-0"))
    assert redis_client.get(keys.done("q-0")) == "expired"

    finished = {k: v.finished_at for k, v in got.items()}
    assert task(app, "expire_deadlines").delay().get() == {"batches": [], "jobs": []}
    again = rows(sql_engine, *finished)
    assert {k: v.finished_at for k, v in again.items()} == finished


# -- batch finalization ------------------------------------------------------------------------

class Hook:
    """A webhook receiver on a local port answering with the queued status codes (then 200);
    with ``hold``, each answer waits until the event is set."""

    def __init__(self, codes: list[int] | None = None,
                 hold: threading.Event | None = None) -> None:
        self.codes = list(codes or [])  # 0: answer garbage instead of HTTP
        self.hold = hold
        self.requests: list[tuple[dict[str, str], bytes]] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.requests.append((dict(self.headers), body))
                if hook.hold is not None:
                    hook.hold.wait(60)
                code = hook.codes.pop(0) if hook.codes else 200
                if code == 0:  # not HTTP at all: http.client raises BadStatusLine
                    self.wfile.write(b"garbage\r\n\r\n")
                    return
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self.requests]


@pytest.fixture
def hook() -> Iterator:  # type: ignore[type-arg]
    hooks: list[Hook] = []

    def make(codes: list[int] | None = None, hold: threading.Event | None = None) -> Hook:
        hooks.append(Hook(codes, hold))
        return hooks[-1]

    yield make
    for h in hooks:
        h.server.shutdown()
        h.server.server_close()


def subscribe(redis_client: redis.Redis, keys: Keys):  # type: ignore[no-untyped-def]
    pubsub = redis_client.pubsub()
    pubsub.subscribe(keys.batch_done_channel())
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    return pubsub


def messages(pubsub) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    out = []
    while (msg := pubsub.get_message(timeout=0.2)) is not None:
        out.append(json.loads(msg["data"]))
    return out


def test_finalize_completes_exports_publishes_and_posts_once(
        control, sql_engine: Engine, redis_client: redis.Redis, keys: Keys, hook,
        tmp_path: Path) -> None:
    receiver = hook()
    app = control(export_dir=str(tmp_path / "out"), webhook_secret="s3cret")
    store = SQL(sql_engine)
    ids = submit(store, 3, batch_id="done", prefix="d-")
    SQL(sql_engine).configure_batch("done", webhook_url=receiver.url)
    succeed(store, ids[0])
    succeed(store, ids[1])
    store.finish([Outcome(ids[2], JobStatus.FAILED, time.time(), error="rejected: too long")])
    submit(store, 2, batch_id="open", prefix="o-")  # one job still queued
    succeed(store, "o-0")
    pubsub = subscribe(redis_client, keys)

    assert task(app, "finalize_batches").delay().get() == ["done"]

    b = batch_row(sql_engine, "done")
    assert (b.status, b.webhook_attempts, b.webhook_error) == ("completed", 1, None)
    assert b.completed_at is not None and b.notified_at is not None
    assert batch_row(sql_engine, "open").status == "in_progress"
    # The results file: every job of the batch as JobInfo JSON, by id.
    lines = jsonl(Path(b.results_path).read_text())
    assert b.results_path == str(tmp_path / "out" / "done.jsonl")
    assert [(x["id"], x["custom_id"], x["status"]) for x in lines] == [
        ("d-0", "row-0", "succeeded"), ("d-1", "row-1", "succeeded"), ("d-2", "row-2", "failed")]
    assert lines[0]["result"]["text"] == "answer d-0" and lines[2]["error"] == "rejected: too long"
    # One event on Redis and one signed POST, with the same content.
    expected = {"type": "batch.completed", "batch_id": "done", "model": MODEL,
                "status": "completed", "num_jobs": 3, "counts": {"failed": 1, "succeeded": 2},
                "completed_at": b.completed_at.isoformat() if b.completed_at.tzinfo else
                b.completed_at.replace(tzinfo=UTC).isoformat(),
                "results_path": b.results_path}
    assert messages(pubsub) == [expected]
    assert redis_client.get(keys.batch_done("done")) == "completed"
    assert receiver.events() == [expected]
    headers, body = receiver.requests[0]
    stamp, mac = (part.split("=", 1)[1] for part in headers["X-Kvbatch-Signature"].split(","))
    assert abs(int(stamp) - time.time()) < 60  # a receiver refuses old stamps: no replays
    assert mac == hmac.new(b"s3cret", f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert headers["Idempotency-Key"] == "done"

    # Idempotent: nothing is due any more, and a direct re-run of the batch does nothing.
    assert task(app, "finalize_batches").delay().get() == []
    assert task(app, "finalize_batch").delay("done").get() == "skipped"
    assert len(receiver.requests) == 1 and messages(pubsub) == []
    pubsub.close()


def test_batch_waits_until_no_job_was_added_for_the_settle_time(control,
                                                                sql_engine: Engine) -> None:
    app = control(batch_settle_s=300.0)
    store = SQL(sql_engine)
    ids = submit(store, 2, batch_id="chunked", submitted_at=time.time() - 10)
    for job_id in ids:
        succeed(store, job_id)
    assert task(app, "finalize_batches").delay().get() == []
    assert batch_row(sql_engine, "chunked").status == "in_progress"


def test_webhook_is_retried_with_backoff_then_delivered(control, sql_engine: Engine,
                                                        redis_client: redis.Redis, keys: Keys,
                                                        hook) -> None:
    receiver = hook([500, 503])
    app = control(webhook_url=receiver.url, webhook_backoff_s=30.0, webhook_max_attempts=5)
    store = SQL(sql_engine)
    succeed(store, submit(store, 1, batch_id="flaky")[0])
    svc = app.kvbatch_services.get()
    pubsub = subscribe(redis_client, keys)
    now = time.time()

    assert ops.complete_batches(svc, now) == ["flaky"]
    assert ops.finalize_batch(svc, "flaky", now) == "retry"
    b = batch_row(sql_engine, "flaky")
    assert (b.webhook_attempts, b.webhook_error, b.notified_at) == (1, "HTTP 500", None)
    next_at = b.webhook_next_at.replace(tzinfo=UTC).timestamp()
    assert next_at == pytest.approx(now + 30.0, abs=1.0)
    # Not due yet: neither listed nor attempted.
    assert ops.complete_batches(svc, now + 10) == []
    assert ops.finalize_batch(svc, "flaky", now + 10) == "skipped"
    assert ops.finalize_batch(svc, "flaky", now + 31) == "retry"
    b = batch_row(sql_engine, "flaky")
    assert b.webhook_next_at.replace(tzinfo=UTC).timestamp() == pytest.approx(now + 91, abs=1.0)
    assert ops.complete_batches(svc, now + 92) == ["flaky"]
    assert ops.finalize_batch(svc, "flaky", now + 92) == "notified"
    b = batch_row(sql_engine, "flaky")
    assert (b.webhook_attempts, b.webhook_error, b.webhook_next_at) == (3, None, None)
    assert b.notified_at is not None
    assert len(receiver.requests) == 3
    assert len(messages(pubsub)) == 1  # the Redis event is not repeated with the retries
    pubsub.close()


def test_webhook_gives_up_after_max_attempts(control, sql_engine: Engine, hook) -> None:
    receiver = hook([500] * 10)
    app = control(webhook_url=receiver.url, webhook_max_attempts=2, webhook_backoff_s=1.0)
    store = SQL(sql_engine)
    succeed(store, submit(store, 1, batch_id="dead")[0])
    svc = app.kvbatch_services.get()
    now = time.time()
    ops.complete_batches(svc, now)
    assert ops.finalize_batch(svc, "dead", now) == "retry"
    assert ops.finalize_batch(svc, "dead", now + 5) == "gave-up"
    b = batch_row(sql_engine, "dead")
    assert (b.webhook_attempts, b.webhook_error) == (2, "HTTP 500")
    assert b.notified_at is not None
    assert ops.finalize_batch(svc, "dead", now + 100) == "skipped"
    assert len(receiver.requests) == 2


def test_a_long_finalization_keeps_its_lock_and_runs_once(control, sql_engine: Engine,
                                                          hook, caplog) -> None:
    """The POST outlasts two lock TTLs: the watchdog renews the lock, so the runs that
    finalize_batches starts meanwhile skip, the receiver gets one POST, and the lock is
    released cleanly at the end. (The receiver answers once those runs are done, however slow
    the machine. A TTL of 2 s: the watchdog renews every third of it, and with 0.5 s a 2-core
    machine loaded by other work missed two renewals in a row.)"""
    answer = threading.Event()
    receiver = hook(hold=answer)
    app = control(webhook_url=receiver.url, task_lock_ttl_s=2.0, webhook_timeout_s=60.0)
    store = SQL(sql_engine)
    succeed(store, submit(store, 1, batch_id="slow")[0])
    svc = app.kvbatch_services.get()
    ops.complete_batches(svc, time.time())
    results: list[str] = []
    # Called directly: result.get() is refused while another thread runs an eager task.
    first = threading.Thread(target=lambda: results.append(task(app, "finalize_batch")("slow")))
    first.start()
    try:
        wait_until(lambda: receiver.requests, 30, what="the webhook's POST")
        time.sleep(4.0)  # two TTLs into the POST
        assert task(app, "finalize_batch")("slow") == "skipped"
        assert task(app, "finalize_batches")() == ["slow"]  # still due: its run skips
    finally:
        answer.set()
        first.join(timeout=30)
    assert results == ["notified"]
    assert len(receiver.requests) == 1
    assert batch_row(sql_engine, "slow").webhook_attempts == 1
    assert not [r for r in caplog.records if "lock" in r.getMessage()]
    assert not svc.redis.exists(svc.keys.control_lock("batch:slow"))


def test_a_broken_http_answer_is_a_counted_attempt(control, sql_engine: Engine, hook) -> None:
    receiver = hook([0, 0])
    app = control(webhook_url=receiver.url, webhook_max_attempts=2, webhook_backoff_s=1.0)
    store = SQL(sql_engine)
    succeed(store, submit(store, 1, batch_id="garbled")[0])
    svc = app.kvbatch_services.get()
    now = time.time()
    ops.complete_batches(svc, now)
    assert ops.finalize_batch(svc, "garbled", now) == "retry"
    b = batch_row(sql_engine, "garbled")
    assert b.webhook_attempts == 1 and "BadStatusLine" in b.webhook_error
    assert ops.finalize_batch(svc, "garbled", now + 0.5) == "skipped"  # backing off
    assert ops.finalize_batch(svc, "garbled", now + 2) == "gave-up"
    assert batch_row(sql_engine, "garbled").notified_at is not None
    assert len(receiver.requests) == 2


def test_a_failing_export_is_retried_then_left_out(control, sql_engine: Engine,
                                                   redis_client: redis.Redis, keys: Keys,
                                                   hook, tmp_path: Path) -> None:
    """An export that cannot be written (here: the export directory is a file) counts as an
    attempt and backs off; after the last attempt the batch is finalized without the file."""
    receiver = hook()
    blocked = tmp_path / "exports"
    blocked.write_text("not a directory")
    app = control(export_dir=str(blocked), webhook_max_attempts=3, webhook_backoff_s=10.0)
    store = SQL(sql_engine)
    succeed(store, submit(store, 1, batch_id="nodisk")[0])
    SQL(sql_engine).configure_batch("nodisk", webhook_url=receiver.url)
    svc = app.kvbatch_services.get()
    pubsub = subscribe(redis_client, keys)
    now = time.time()
    ops.complete_batches(svc, now)
    assert ops.finalize_batch(svc, "nodisk", now) == "retry"
    assert ops.finalize_batch(svc, "nodisk", now + 5) == "skipped"
    assert ops.finalize_batch(svc, "nodisk", now + 11) == "retry"
    b = batch_row(sql_engine, "nodisk")
    assert b.webhook_attempts == 2 and b.webhook_error.startswith("export failed: ")
    assert b.notified_at is None and receiver.requests == [] and messages(pubsub) == []
    assert ops.finalize_batch(svc, "nodisk", now + 32) == "gave-up"
    b = batch_row(sql_engine, "nodisk")
    assert b.notified_at is not None and b.results_path is None
    assert b.webhook_error.startswith("export failed: ")
    assert [e["results_path"] for e in receiver.events()] == [None]
    assert [e["batch_id"] for e in messages(pubsub)] == ["nodisk"]
    pubsub.close()


def test_settle_time_is_measured_on_the_database_clock(sql_engine: Engine) -> None:
    """A control host whose clock runs an hour ahead does not finalize a batch that is still
    receiving jobs."""
    store = SQL(sql_engine)
    for job_id in submit(store, 2, batch_id="skewed"):
        succeed(store, job_id)
    assert SQL(sql_engine).complete_batches(time.time() + 3600, settle_s=300.0) == []
    assert SQL(sql_engine).complete_batches(time.time(), settle_s=0.0) == ["skewed"]


# -- retention ---------------------------------------------------------------------------------

def test_purge_drops_old_results_then_old_rows(control, sql_engine: Engine) -> None:
    app = control(results_retention_days=30.0, jobs_retention_days=90.0, purge_chunk=2)
    store = SQL(sql_engine)
    now = time.time()
    submit(store, 5, prefix="p-", submitted_at=now - 100 * DAY_S)
    for i, age_days in enumerate([100, 95, 40, 35, 1]):
        succeed(store, f"p-{i}", finished_at=now - age_days * DAY_S)

    assert task(app, "purge_results").delay().get() == {"results_purged": 4, "jobs_deleted": 2}

    got = rows(sql_engine, *(f"p-{i}" for i in range(5)))
    assert sorted(got) == ["p-2", "p-3", "p-4"]
    assert [(got[j].text, got[j].token_ids) for j in ("p-2", "p-3")] == [(None, None)] * 2
    assert (got["p-4"].text, got["p-4"].token_ids) == ("answer p-4", [1, 2, 3])
    with Session(sql_engine) as session:
        kept = set(session.scalars(select(JobMetrics.job_id)))
    assert kept == {"p-2", "p-3", "p-4"}  # stats stay for the dashboards
    assert task(app, "purge_results").delay().get() == {"results_purged": 0, "jobs_deleted": 0}


# -- reaper ------------------------------------------------------------------------------------

def test_reaper_fails_jobs_past_the_delivery_limit_on_no_live_worker(
        control, sql_engine: Engine, redis_client: redis.Redis, keys: Keys) -> None:
    app = control(max_deliveries=3)
    store = SQL(sql_engine)
    ids = submit(store, 5, prefix="r-")
    now = time.time()
    store.begin_deliveries(["r-1", "r-3"], "dead-worker", max_deliveries=3, now_s=now)
    store.begin_deliveries(["r-2"], "live-worker", max_deliveries=3, now_s=now)
    redis_client.hset(keys.workers(), mapping={"dead-worker": MODEL, "live-worker": MODEL})
    redis_client.set(keys.heartbeat("live-worker"), MODEL, px=60_000)
    with Session(sql_engine) as session, session.begin():
        session.execute(update(Job).where(Job.id.in_(["r-0", "r-1", "r-2"])).values(attempts=3))

    assert task(app, "reap_jobs").delay().get() == ["r-0", "r-1"]

    got = rows(sql_engine, *ids)
    assert {k: v.status for k, v in got.items()} == {
        "r-0": "failed", "r-1": "failed", "r-2": "running", "r-3": "running", "r-4": "queued"}
    assert got["r-1"].error.startswith("dead-lettered: delivered 3 times (limit 3)")
    dead = redis_client.xrange(keys.dead_letter(MODEL))
    assert sorted(fields["id"] for _, fields in dead) == ["r-0", "r-1"]
    assert json.loads(dead[0][1]["job"])["model"] == MODEL
    assert redis_client.get(keys.done("r-0")) == "failed"

    assert task(app, "reap_jobs").delay().get() == []
    assert len(redis_client.xrange(keys.dead_letter(MODEL))) == 2


def test_reaper_asks_for_live_workers_after_locking_the_jobs(sql_engine: Engine) -> None:
    """A worker that takes a job between the start of a reaper run and its transaction is
    live by the time the reaper decides; and the reaper pages past jobs it must keep."""
    store = SQL(sql_engine)
    submit(store, 5, prefix="k-")
    now = time.time()
    store.begin_deliveries(["k-0", "k-1"], "late-worker", max_deliveries=3, now_s=now)
    with Session(sql_engine) as session, session.begin():
        session.execute(update(Job).values(attempts=3))
    asked: list[set[str]] = []

    def live() -> set[str]:  # the heartbeat appeared after the run started
        asked.append({"late-worker"})
        return {"late-worker"}

    reaped: list[str] = []
    after: str | None = ""
    while after is not None:
        page, after = store.reap_overdelivered(3, live, now, limit=2, after_id=after)
        reaped += [job_id for job_id, _, _ in page]
    assert reaped == ["k-2", "k-3", "k-4"] and asked
    assert {k: v.status for k, v in rows(sql_engine, "k-0", "k-1").items()} == {
        "k-0": "running", "k-1": "running"}


def test_expiry_and_reaping_page_through_everything_in_one_run(
        control, sql_engine: Engine, redis_client: redis.Redis, keys: Keys) -> None:
    app = control(page_size=2, max_deliveries=3)
    store = SQL(sql_engine)
    past = datetime.now(UTC) - timedelta(seconds=10)
    now = time.time()
    big = submit(store, 5, batch_id="big", prefix="big-")
    SQL(sql_engine).configure_batch("big", deadline=to_dt(now - 1))
    loose = submit(store, 5, prefix="loose-", deadline=past)
    report = task(app, "expire_deadlines").delay().get()
    assert report == {"batches": ["big"], "jobs": sorted(big + loose)}
    assert batch_row(sql_engine, "big").status == "expired"
    with Session(sql_engine) as session:
        assert len(session.scalars(select(JobMetrics.job_id)).all()) == 10
    # Reaping: the first page holds only jobs of a live worker; the rest are still reaped.
    held = submit(store, 2, prefix="a-")
    dead = submit(store, 3, prefix="z-")
    store.begin_deliveries(held, "alive", max_deliveries=3, now_s=now)
    redis_client.hset(keys.workers(), mapping={"alive": MODEL})
    redis_client.set(keys.heartbeat("alive"), MODEL, px=60_000)
    with Session(sql_engine) as session, session.begin():
        session.execute(update(Job).where(Job.id.in_(held + dead)).values(attempts=3))
    assert task(app, "reap_jobs").delay().get() == dead


def test_every_scheduled_task_runs_once_at_start(control, sql_engine: Engine) -> None:
    """What run_control does when its worker is ready: the purge does not wait an hour."""
    from worker.control.app import run_scheduled_once

    app = control(results_retention_days=1.0)
    store = SQL(sql_engine)
    submit(store, 1, prefix="old-", submitted_at=time.time() - 3 * DAY_S)
    succeed(store, "old-0", finished_at=time.time() - 2 * DAY_S)
    assert sorted(run_scheduled_once(app)) == [
        f"kvbatch.control.{n}" for n in
        ("expire_deadlines", "finalize_batches", "purge_results", "reap_jobs")]
    assert rows(sql_engine, "old-0")["old-0"].text is None


# -- the app -----------------------------------------------------------------------------------

def test_app_is_json_only_acks_late_and_schedules_every_task(keys: Keys) -> None:
    app = make_app(settings_for(keys, "sqlite://"))
    conf = app.conf
    assert conf.accept_content == ["json"] and conf.result_accept_content == ["json"]
    assert conf.task_serializer == conf.result_serializer == conf.event_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.beat_scheduler == "celery.beat:Scheduler"  # no shelve (pickle) file
    assert conf.broker_transport_options["global_keyprefix"] == f"{keys.prefix}:celery:"
    scheduled = {entry["task"] for entry in conf.beat_schedule.values()}
    assert scheduled == {f"kvbatch.control.{n}" for n in
                         ("expire_deadlines", "finalize_batches", "reap_jobs", "purge_results")}
    assert scheduled <= set(app.tasks)


def test_tasks_travel_through_redis_to_a_real_worker(keys: Keys, pg_engine: Engine,
                                                     pg_url: str, hook) -> None:
    """JSON over the real broker: the beat task reaches a worker thread, which finalizes the
    batch and fans out finalize_batch through Redis too."""
    from celery.contrib.testing.worker import start_worker

    receiver = hook()
    app = make_app(settings_for(keys, pg_url, webhook_url=receiver.url))
    store = SQL(pg_engine)
    succeed(store, submit(store, 1, batch_id="live")[0])
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        app.tasks["kvbatch.control.finalize_batches"].delay()
        deadline = time.monotonic() + 30
        while batch_row(pg_engine, "live").notified_at is None:
            assert time.monotonic() < deadline, "batch not finalized by the worker"
            time.sleep(0.1)
    assert batch_row(pg_engine, "live").status == "completed"
    assert [e["batch_id"] for e in receiver.events()] == ["live"]
    app.kvbatch_services.close()


def test_webhook_posts_have_their_own_slots(keys: Keys, sql_engine: Engine, hook) -> None:  # type: ignore[no-untyped-def]
    """Slow receivers hold at most webhook_concurrency control threads: a batch that finds
    every slot taken is finalized on a later pass, its attempt not counted."""
    receiver = hook()
    settings = settings_for(keys, str(sql_engine.url.render_as_string(False)),
                            webhook_url=receiver.url, webhook_concurrency=1)
    svc = ops.Services.connect(settings)
    store = SQL(sql_engine)
    submit(store, 1, batch_id="slow", prefix="s")
    succeed(store, "s0")
    assert store.complete_batches(time.time(), settle_s=0.0) == ["slow"]
    try:
        assert svc.webhook_slots.acquire(blocking=False)  # a POST to a slow receiver, elsewhere
        assert ops.finalize_batch(svc, "slow", time.time()) == "busy"
        assert receiver.requests == []
        assert store.load("slow").webhook_attempts == 0
        svc.webhook_slots.release()
        assert ops.finalize_batch(svc, "slow", time.time()) == "notified"
        assert len(receiver.requests) == 1
    finally:
        svc.close()
