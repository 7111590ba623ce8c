"""End-to-end: jobs flow from Redis through a worker running the tiny model into SQL."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import redis
import sqlalchemy as sa
from prometheus_client import generate_latest
from services import all_roles_store
from worker_harness import RunningWorker, paced, worker_settings

from jobs.client import JobClient
from jobs.constants import FIELD_ID, FIELD_JOB, Keys
from jobs.queue import JobQueue
from jobs.schemas import JobSpec, JobStatus

SQL = all_roles_store()

MODEL = "tiny"


def _job(i: int, **kw) -> JobSpec:  # type: ignore[no-untyped-def]
    sampling = {"temperature": 0.0, "max_tokens": 8, **kw.pop("sampling", {})}
    if i % 2:
        return JobSpec(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                       sampling=sampling, **kw)
    return JobSpec(model=MODEL, prompt=f"shared system prompt, then job {i}",
                   sampling=sampling, **kw)


def _long(i: int, max_tokens: int = 1500, **kw) -> JobSpec:  # type: ignore[no-untyped-def]
    return _job(i, sampling={"max_tokens": max_tokens, "ignore_eos": True}, **kw)


def _statuses(client: JobClient, ids: list[str]) -> dict[str, JobStatus]:
    return {i.id: i.status for i in client.get_many(ids)}


def test_200_jobs_end_to_end(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                             start_worker, wait_for) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_job(i, batch_id="b1", custom_id=f"row-{i}") for i in range(200)])
    running = start_worker()
    infos = client.wait(ids, timeout_s=120)
    assert [i.status for i in infos] == [JobStatus.SUCCEEDED] * 200
    for info in infos:
        assert info.attempts == 1 and info.worker_id == running.worker.worker_id
        assert info.result.usage.completion_tokens == len(info.result.token_ids) > 0
        assert info.stats.ttft_s >= info.stats.queue_wait_s >= 0
        assert info.stats.e2e_s >= info.stats.ttft_s and info.stats.peak_kv_blocks >= 1
    with pg_engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT job_id, status, prompt_tokens, generated_tokens FROM job_stats "
            "WHERE batch_id = 'b1'")).all()
        n_metrics = conn.execute(sa.text("SELECT count(*) FROM job_metrics")).scalar()
    assert sorted(r.job_id for r in rows) == sorted(ids) and n_metrics == 200
    assert all(r.status == "succeeded" and r.generated_tokens > 0 for r in rows)
    # Everything acked and deleted from the stream; Prometheus saw every job.
    wait_for(lambda: JobQueue(redis_client, MODEL, keys).depth() == (0, 0), 30)
    text = generate_latest(running.worker.metrics.registry).decode()
    assert 'kvbatch_jobs_total{model_name="tiny",status="succeeded"} 200.0' in text
    for name in ("kvbatch_time_to_first_token_seconds_count", "kvbatch_kv_cache_usage_perc",
                 "kvbatch_prefix_cache_hits_total", "kvbatch_generation_tokens_total",
                 "kvbatch_inter_token_latency_seconds_count", "kvbatch_queue_depth",
                 "kvbatch_queue_backlog"):
        assert name in text
    assert running.stop() == 0


def test_pull_never_exceeds_free_capacity(redis_client: redis.Redis, keys: Keys,
                                          pg_engine: sa.Engine, pg_url: str,
                                          tiny_model: str) -> None:
    from worker.loop import Worker
    from worker.main import build_engine

    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_long(i, max_tokens=200) for i in range(30)])
    settings = worker_settings(tiny_model, keys, pg_url, max_num_seqs=4, waiting_buffer=2)
    worker = Worker(settings, build_engine(settings), db=pg_engine)
    assert settings.capacity == 6
    # Checked on the worker's thread, right after each pull: held jobs and undecided
    # deliveries change only on that thread, and unsaved results only shrink meanwhile (the
    # writer stores them), so what is read there is what the pull left the worker holding.
    # (XPENDING read from here would also count stored results whose ack is on its way.)
    pulls: list[tuple[int, int, int]] = []  # (asked, pulled, held + undecided + unsaved)
    pull = worker.intake.pull

    def checked_pull(now: float, count: int, held, idle: bool) -> int:  # type: ignore[no-untyped-def]
        n = pull(now, count, held, idle)
        pulls.append((count, n, len(worker.held) + len(worker.intake) + len(worker.results)))
        return n

    worker.intake.pull = checked_pull  # type: ignore[method-assign]
    running = RunningWorker(worker)
    try:
        infos = client.wait(ids, timeout_s=240)
    finally:
        running.stop(drain=False)
    assert all(i.status is JobStatus.SUCCEEDED for i in infos)
    assert pulls and all(n <= asked for asked, n, _ in pulls), pulls
    assert max(holding for _, _, holding in pulls) <= settings.capacity, pulls
    assert max(holding for _, _, holding in pulls) >= 4  # the engine was kept full


def test_bad_jobs_fail_alone_with_readable_errors(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    good = [_job(i) for i in range(4)]
    too_long = _job(10, sampling={"max_tokens": 4})
    too_long = too_long.model_copy(update={"prompt": "x" * 400, "messages": None})
    other_model = JobSpec(model="no-such-model", prompt="hi")
    ids = client.submit([*good, too_long])
    # Messages the SDK would never produce: not JSON, wrong schema, a sampling value the engine
    # refuses (the SDK checks it at submission), wrong model for the stream.
    not_json, wrong_schema, bad_sampling = _job(20), _job(21), _job(12)
    SQL(client.engine).insert_jobs([not_json, wrong_schema, bad_sampling, other_model])
    q = JobQueue(redis_client, MODEL, keys)
    bad_payload = {**bad_sampling.model_dump(mode="json"), "sampling": {"temperature": -1.0}}
    redis_client.xadd(q.streams[0], {FIELD_ID: bad_sampling.id, FIELD_JOB: json.dumps(bad_payload)})
    redis_client.xadd(q.streams[0], {FIELD_ID: not_json.id, FIELD_JOB: "{not json"})
    redis_client.xadd(q.streams[0], {FIELD_ID: wrong_schema.id,
                                 FIELD_JOB: json.dumps({"id": wrong_schema.id, "model": MODEL})})
    redis_client.xadd(q.streams[0], {FIELD_ID: other_model.id,
                                 FIELD_JOB: other_model.model_dump_json()})
    redis_client.xadd(q.streams[0], {"junk": "no id at all"})
    start_worker(max_model_len=256)

    infos = {i.id: i for i in client.wait([*ids, not_json.id, wrong_schema.id, bad_sampling.id,
                                           other_model.id], timeout_s=60)}
    assert all(infos[s.id].status is JobStatus.SUCCEEDED for s in good)
    expected = {
        too_long.id: "max_model_len",
        bad_sampling.id: "temperature must be >= 0.0",
        not_json.id: "malformed job message",
        wrong_schema.id: "exactly one of 'prompt', 'raw_prompt', 'messages' and 'embed'",
        other_model.id: "unknown model 'no-such-model'",
    }
    for job_id, fragment in expected.items():
        assert infos[job_id].status is JobStatus.FAILED, job_id
        assert fragment in infos[job_id].error, infos[job_id].error
        assert infos[job_id].stats is not None  # every terminal job has its stats row
    ((_, dead),) = redis_client.xrange(keys.dead_letter(MODEL))
    assert "malformed job message" in dead["reason"]


def test_cancel_running_job_frees_its_blocks(redis_client: redis.Redis, keys: Keys,
                                            pg_engine: sa.Engine, start_worker,
                                            wait_for) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    long_id, queued_id = client.submit([_long(0, max_tokens=1900), _long(1)])
    assert client.cancel(queued_id) is JobStatus.CANCELLED  # no worker yet: cancelled at once
    running = start_worker(engine_wrapper=paced)
    w = running.worker
    wait_for(lambda: w.engine_stats is not None and long_id in w.held
             and w.engine_stats.num_kv_blocks_free < w.engine_stats.num_kv_blocks_total)
    assert client.cancel(long_id) is JobStatus.RUNNING
    (info,) = client.wait([long_id], timeout_s=10)
    assert info.status is JobStatus.CANCELLED and info.result.finish_reason == "abort"
    assert 0 < len(info.result.token_ids) < 1900
    wait_for(lambda: w.engine_stats.num_kv_blocks_free == w.engine_stats.num_kv_blocks_total
             and w.engine_stats.num_running == 0, 30)
    assert client.get(queued_id).attempts == 0  # never delivered to the engine


def test_deadlines_expire_jobs(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                               start_worker, wait_for) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    running = start_worker(engine_wrapper=paced)
    wait_for(lambda: running.worker.engine_stats is not None)  # up before the deadlines start
    now = datetime.now(UTC)
    late = _job(0, deadline=now - timedelta(seconds=1))
    slow = _long(1, max_tokens=1900, deadline=now + timedelta(seconds=6))  # paced: >= 9.5 s
    fine = _job(2, deadline=now + timedelta(minutes=5))
    client.submit([late, slow, fine])
    infos = {i.id: i for i in client.wait([late.id, slow.id, fine.id], timeout_s=30)}
    assert infos[late.id].status is JobStatus.EXPIRED and infos[late.id].result is None
    assert infos[slow.id].status is JobStatus.EXPIRED
    assert 0 < len(infos[slow.id].result.token_ids) < 1900  # stopped mid-generation
    assert infos[fine.id].status is JobStatus.SUCCEEDED


def test_graceful_shutdown_hands_back_unfinished_jobs(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    quick = client.submit([_job(i) for i in range(3)])
    slow = client.submit([_long(10 + i, max_tokens=1900) for i in range(3)])
    first = start_worker(engine_wrapper=paced, drain_timeout_s=0.5)
    wait_for(lambda: set(_statuses(client, quick).values()) == {JobStatus.SUCCEEDED})
    wait_for(lambda: set(_statuses(client, slow).values()) == {JobStatus.RUNNING})
    assert first.stop() == 0
    for info in client.get_many(slow):  # handed back: queued again, the attempt not counted
        assert (info.status, info.attempts, info.worker_id) == (JobStatus.QUEUED, 0, None)
    second = start_worker()
    infos = client.wait(slow, timeout_s=60)
    assert all(i.status is JobStatus.SUCCEEDED and i.attempts == 1 for i in infos)
    assert {i.worker_id for i in infos} == {second.worker.worker_id}


def test_redis_data_loss_is_reconciled(redis_client: redis.Redis, keys: Keys,
                                       pg_engine: sa.Engine,
                                       start_worker) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_job(i) for i in range(10)])
    redis_client.delete(*JobQueue(redis_client, MODEL, keys).streams)  # Redis lost its data
    start_worker(reconcile_interval_s=0.3)
    infos = client.wait(ids, timeout_s=30)
    assert all(i.status is JobStatus.SUCCEEDED and i.attempts == 1 for i in infos)


def test_database_outage_delays_results_without_losing_them(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([_long(i, max_tokens=300) for i in range(4)])
    start_worker()
    wait_for(lambda: set(_statuses(client, ids).values()) == {JobStatus.RUNNING})
    with pg_engine.begin() as conn:  # results cannot be stored while job_metrics is gone
        conn.execute(sa.text("ALTER TABLE job_metrics RENAME TO job_metrics_offline"))
    q = JobQueue(redis_client, MODEL, keys)
    time.sleep(2.0)
    with pg_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT DISTINCT status FROM jobs")).scalars().all() == [
            "running"]
    assert q.depth() == (0, 4)  # generated, not stored, so not acknowledged
    with pg_engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE job_metrics_offline RENAME TO job_metrics"))
    infos = client.wait(ids, timeout_s=30)
    assert all(i.status is JobStatus.SUCCEEDED and i.stats is not None for i in infos)
    wait_for(lambda: q.depth() == (0, 0), 30)


def test_parallel_samples_and_logprobs_are_stored(redis_client: redis.Redis, keys: Keys,
                                                  pg_engine: sa.Engine,
                                                  start_worker) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    spec = _job(0, sampling={"n": 2, "temperature": 0.8, "seed": 1, "logprobs": 2,
                             "max_tokens": 5})
    (job_id,) = client.submit([spec])
    start_worker()
    (info,) = client.wait([job_id], timeout_s=30)
    assert info.status is JobStatus.SUCCEEDED
    assert [c.index for c in info.result.choices] == [0, 1]
    assert info.result.token_ids == info.result.choices[0].token_ids
    assert len(info.result.logprobs) == len(info.result.token_ids)
    for token_id, lp in zip(info.result.token_ids, info.result.logprobs, strict=True):
        # the sampled token with its text and bytes; the 2 most likely, best first
        assert lp.token_id == token_id and lp.logprob <= 0
        assert lp.token == bytes(lp.bytes).decode(errors="replace")
        assert len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob >= lp.logprob - 1e-6 \
            or lp.token_id in {t.token_id for t in lp.top_logprobs}
    assert info.result.usage.completion_tokens == sum(len(c.token_ids)
                                                      for c in info.result.choices)


def test_embedded_sqlite_database(redis_client: redis.Redis, keys: Keys, sqlite_url: str,
                                  start_worker) -> None:  # type: ignore[no-untyped-def]
    from jobs import db

    db.upgrade(sqlite_url)
    client = JobClient(redis_client, sqlite_url, key_prefix=keys.prefix)
    ids = client.submit([_job(i) for i in range(20)])
    running = start_worker(database_url=sqlite_url)
    infos = client.wait(ids, timeout_s=60)
    assert all(i.status is JobStatus.SUCCEEDED and i.stats.ttft_s is not None for i in infos)
    assert running.stop() == 0
    with db.make_engine(sqlite_url).connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM job_stats")).scalar() == 20
