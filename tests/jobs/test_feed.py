"""SQL holds the backlog, Redis a bounded window (``jobs.feed``): the window's size, the
feeder's order (priority, then round-robin over batches), exactly-once marking, recovery of
lost entries, and a worker draining a backlog many times its window, on PostgreSQL and
SQLite."""

from __future__ import annotations

import json
import threading
import time

import redis
import sqlalchemy as sa
from services import all_roles_store, wait_until

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.feed import MIN_WINDOW, Feeder
from jobs.queue import JobQueue
from jobs.reconcile import reconcile
from jobs.schemas import JobSpec, JobStatus
from jobs.store import FeedStore

SQL = all_roles_store()
MODEL = "tiny"


def _fed(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.text("SELECT count(*) FROM jobs WHERE fed_at IS NOT NULL")))


def test_backlog_beyond_the_window_stays_in_sql(redis_client: redis.Redis, keys: Keys,
                                                sql_engine: sa.Engine) -> None:
    client = JobClient(redis_client, sql_engine, key_prefix=keys.prefix)
    q = JobQueue(redis_client, MODEL, keys)
    few = [JobSpec(model=MODEL, prompt=f"p{i}") for i in range(10)]
    client.submit(few)  # room in the window and no backlog: straight to the stream
    assert q.length() == 10 and _fed(sql_engine) == 10
    client.submit([JobSpec(model=MODEL, prompt=f"q{i}") for i in range(MIN_WINDOW + 300)])
    assert q.length() == MIN_WINDOW == _fed(sql_engine)  # the rest waits in SQL
    assert client.feed_store.has_backlog(MODEL)
    assert client.count_by_status() == {JobStatus.QUEUED: MIN_WINDOW + 310}
    q.ensure_group()
    entries = q.read("w", count=MIN_WINDOW)
    assert [d.job_id for d in entries[:10]] == [s.id for s in few]  # first come, first fed
    q.ack(entries[:100])
    assert Feeder(q, FeedStore(sql_engine)).feed() == 100 and q.length() == MIN_WINDOW


def test_window_is_what_live_workers_ask_for(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, MODEL, keys)
    assert q.window(MIN_WINDOW) == MIN_WINDOW  # no worker: the floor
    q.heartbeat("w1", 60_000, window=600)
    q.heartbeat("w2", 60_000, window=300)
    assert q.window(MIN_WINDOW) == 900
    redis_client.delete(keys.heartbeat("w2"))  # w2 died
    assert q.window(MIN_WINDOW) == 600
    assert redis_client.hkeys(keys.feed_windows(MODEL)) == ["w1"]
    q.drop_heartbeat("w1")
    assert q.window(MIN_WINDOW) == MIN_WINDOW


def test_order_is_priority_then_round_robin_over_batches(sql_engine: sa.Engine) -> None:
    big = [JobSpec(model=MODEL, prompt=f"b{i}", batch_id="big", custom_id=f"{i}")
           for i in range(40)]
    small = [JobSpec(model=MODEL, prompt=f"s{i}", batch_id="small", custom_id=f"{i}")
             for i in range(4)]
    loose = [JobSpec(model=MODEL, prompt="loose")]
    later = [JobSpec(model=MODEL, prompt=f"l{i}", priority=5) for i in range(3)]
    urgent = [JobSpec(model=MODEL, prompt="urgent", priority=-10)]
    store = SQL(sql_engine)
    for specs in (big, small, loose, later, urgent):  # in this order: the urgent job last
        store.insert_jobs(specs)
    feed = FeedStore(sql_engine)
    first, failed = feed.take(MODEL, 10)
    assert failed == []
    assert first[0].id == urgent[0].id  # the best priority first, whenever it came
    rest = [s.id for s in first[1:]]
    # Then priority 0, round-robin: the job without a batch, big and small in turn, each
    # batch oldest first.
    assert set(rest[:3]) == {loose[0].id, big[0].id, small[0].id}
    assert [i for i in rest if i in {s.id for s in small}] == [s.id for s in small]
    assert [i for i in rest if i in {s.id for s in big}] == [s.id for s in big[:4]]
    second, _ = feed.take(MODEL, 100)
    assert [s.id for s in second] == [s.id for s in big[4:]] + [s.id for s in later]
    assert feed.take(MODEL, 100) == ([], [])  # each job fed once
    assert not feed.has_backlog(MODEL)


def test_concurrent_feeders_take_each_job_once(pg_engine: sa.Engine) -> None:
    specs = [JobSpec(model=MODEL, prompt=f"p{i}", batch_id=f"b{i % 3}", custom_id=f"{i}")
             for i in range(600)]
    SQL(pg_engine).insert_jobs(specs)
    taken: list[list[str]] = [[], [], []]

    def take(k: int) -> None:
        feed = FeedStore(pg_engine)
        while batch := feed.take(MODEL, 25)[0]:
            taken[k] += [s.id for s in batch]

    threads = [threading.Thread(target=take, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = [i for part in taken for i in part]
    assert sorted(every) == sorted(s.id for s in specs)  # all, none twice
    assert all(taken)


def test_the_backlog_is_counted_and_a_workers_gauge_reports_it(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    client.submit([JobSpec(model=MODEL, prompt=f"p{i}") for i in range(MIN_WINDOW + 50)])
    assert client.feed_store.backlog(MODEL) == 50  # the window took MIN_WINDOW
    running = start_worker(feed_window=1, max_num_seqs=1, waiting_buffer=0)
    registry = running.worker.metrics.registry

    def reported() -> float:
        return registry.get_sample_value("kvbatch_queue_backlog", {"model_name": MODEL}) or 0.0

    # The worker drains the backlog a window at a time; its first count sees most of it.
    wait_until(lambda: reported() > 0, 30, what="a backlog count")
    assert 0 < reported() <= 50
    assert client.feed_store.backlog(MODEL) <= reported()


def test_lost_entries_of_fed_jobs_come_back_and_the_backlog_stays(
        redis_client: redis.Redis, keys: Keys, sql_engine: sa.Engine) -> None:
    client = JobClient(redis_client, sql_engine, key_prefix=keys.prefix)
    client.submit([JobSpec(model=MODEL, prompt=f"p{i}") for i in range(MIN_WINDOW + 50)])
    q = JobQueue(redis_client, MODEL, keys)
    redis_client.delete(*q.streams)  # Redis lost its data
    report = reconcile(SQL(sql_engine), q, grace_s=0.0)
    assert len(report.requeued) == MIN_WINDOW == q.length()  # the fed ones only
    assert client.feed_store.has_backlog(MODEL)


def test_a_stored_job_no_longer_valid_fails_when_fed(redis_client: redis.Redis, keys: Keys,
                                                     sql_engine: sa.Engine) -> None:
    good, old = JobSpec(model=MODEL, prompt="fine"), JobSpec(model=MODEL, prompt="old")
    SQL(sql_engine).insert_jobs([good, old])
    with sql_engine.begin() as conn:  # as an older kvbatch stored it: a top_k now refused
        spec = {**old.model_dump(mode="json"), "sampling": {"top_k": 2**40}}
        conn.execute(sa.text("UPDATE jobs SET spec = :spec WHERE id = :id"),
                     {"spec": json.dumps(spec), "id": old.id})
    q = JobQueue(redis_client, MODEL, keys)
    assert Feeder(q, FeedStore(sql_engine)).feed() == 1
    assert q.job_ids_in_stream() == {good.id}
    info = JobClient(redis_client, sql_engine, key_prefix=keys.prefix).get(old.id)
    assert info is not None and info.status is JobStatus.FAILED
    assert info.error is not None and info.error.startswith("stored job no longer valid:")


def test_worker_drains_a_backlog_many_windows_long_in_fair_order(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    q = JobQueue(redis_client, MODEL, keys)
    start_worker(feed_window=40)
    wait_until(lambda: q.window(MIN_WINDOW) == 40, 30, what="the worker's window")
    sampling = {"max_tokens": 2, "ignore_eos": True}
    big = [JobSpec(model=MODEL, prompt=f"big {i}", batch_id="big", custom_id=f"{i}",
                   sampling=sampling) for i in range(600)]
    client.submit_batch("big", big)
    small = [JobSpec(model=MODEL, prompt=f"small {i}", batch_id="small", custom_id=f"{i}",
                     sampling=sampling) for i in range(5)]
    client.submit_batch("small", small)
    urgent = JobSpec(model=MODEL, prompt="urgent", priority=-10, sampling=sampling)
    client.submit([urgent])
    longest = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        longest = max(longest, q.length())
        counts = client.count_by_status()
        if not counts.get(JobStatus.QUEUED) and not counts.get(JobStatus.RUNNING):
            break
        time.sleep(0.01)
    assert client.count_by_status() == {JobStatus.SUCCEEDED: len(big) + len(small) + 1}
    assert q.window(MIN_WINDOW) == 40
    assert 0 < longest <= 40  # the worker's window, never the backlog
    with pg_engine.connect() as conn:  # jobs fed while each one waited to be
        fed_before = dict(conn.execute(sa.text(
            "SELECT j.id, (SELECT count(*) FROM jobs o WHERE o.fed_at < j.fed_at"
            " AND o.fed_at > j.created_at) FROM jobs j")).all())
    # The urgent job and the small batch do not wait for the backlog of the big batch
    # submitted before them: at most the window that was full when they came, and one more
    # (what the worker fed before they were stored, however slow the machine, is not theirs
    # to wait for).
    assert fed_before[urgent.id] <= 2 * 40
    assert max(fed_before[s.id] for s in small) <= 2 * 40


def test_the_stream_delivers_a_better_priority_first(redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    """Within the window too: an urgent job goes before the undelivered entries of worse
    priority; equal priorities keep their order, and delivered entries are never moved."""
    q = JobQueue(redis_client, MODEL, keys)
    q.ensure_group()
    normal = [JobSpec(model=MODEL, prompt=f"n{i}") for i in range(5)]
    q.enqueue(normal)
    (first,) = q.read("w", count=1)
    assert first.job_id == normal[0].id
    later = JobSpec(model=MODEL, prompt="later", priority=5)
    urgent = [JobSpec(model=MODEL, prompt=f"u{i}", priority=-10) for i in range(2)]
    q.enqueue([later])
    q.enqueue(urgent)
    order = [d.job_id for d in q.read("w", count=10)]
    assert order == [u.id for u in urgent] + [s.id for s in normal[1:]] + [later.id]
    assert q.depth() == (0, 8)  # nothing lost or doubled; the first delivery still pending
    q.ack([first])
    assert q.depth() == (0, 7)


def test_a_bulk_load_refreshes_the_planner_statistics(redis_client: redis.Redis, keys: Keys,
                                                      pg_engine: sa.Engine) -> None:
    """Right after a million rows, before autovacuum runs, PostgreSQL took the batch for a few
    hundred rows and a cancel sorted the whole batch for every page."""
    from jobs.client import ANALYZE_AFTER_ROWS

    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)

    def analyzed() -> bool:
        with pg_engine.connect() as conn:
            return conn.scalar(sa.text(
                "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables "
                "WHERE relname = 'jobs' AND schemaname = current_schema()")) is True

    client.bulk_loaded(ANALYZE_AFTER_ROWS - 1)
    assert not analyzed()
    client.bulk_loaded(ANALYZE_AFTER_ROWS)
    deadline = time.monotonic() + 10
    while not analyzed() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert analyzed()


def test_share_is_per_tenant_then_per_batch(sql_engine: sa.Engine) -> None:
    """A key with five batches gets no more of the stream than a key with one: the feeder's
    moves alternate between the two owners, and the first's spread over its batches."""
    many = {f"a{b}": [JobSpec(model=MODEL, prompt=f"a{b}-{i}", batch_id=f"a{b}",
                              custom_id=f"{i}") for i in range(10)] for b in range(5)}
    one = [JobSpec(model=MODEL, prompt=f"b{i}", batch_id="b0", custom_id=f"{i}")
           for i in range(10)]
    store = SQL(sql_engine)
    for specs in (*many.values(), one):
        store.insert_jobs(specs)
    with sql_engine.begin() as conn:
        conn.execute(sa.text("UPDATE batches SET owner = CASE WHEN id = 'b0' THEN 'key-b' "
                             "ELSE 'key-a' END"))
    first, _ = FeedStore(sql_engine).take(MODEL, 10)
    owners = ["key-b" if s.batch_id == "b0" else "key-a" for s in first]
    assert owners == ["key-a", "key-b"] * 5
    assert sorted(s.batch_id for s in first if s.batch_id != "b0") == sorted(many)
    rest, _ = FeedStore(sql_engine).take(MODEL, 60)
    assert [s.batch_id for s in rest].count("b0") == 5  # what was left of it
