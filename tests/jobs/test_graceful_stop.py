"""A graceful stop loses no work: a draining worker finishes its in-flight jobs itself, and
handing the rest back stores the results that already finished first."""

from __future__ import annotations

import threading
import time

import redis
import sqlalchemy as sa
from worker_harness import bare_worker, long_job

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome

MODEL = "tiny"


def test_drain_finishes_in_flight_jobs_on_the_same_worker(
    redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker, wait_for,
) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    ids = client.submit([long_job(i, max_tokens=1500) for i in range(4)])  # ~1-2 s each
    running = start_worker(drain_timeout_s=120.0)  # room for a slow machine
    wait_for(lambda: {i.status for i in client.get_many(ids)} == {JobStatus.RUNNING})
    stopper = threading.Thread(target=running.stop, kwargs={"timeout_s": 150})
    stopper.start()
    stopper.join(160)
    assert running.rc == 0
    for info in client.get_many(ids):
        assert (info.status, info.attempts, info.worker_id) == (
            JobStatus.SUCCEEDED, 1, running.worker.worker_id)
        assert len(info.result.token_ids) == 1500


def test_hand_back_stores_finished_results_first(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
) -> None:
    w = bare_worker(tiny_model, keys, pg_url, pg_engine, redis_client)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    (job_id,) = client.submit([JobSpec(model=MODEL, prompt="a")])
    (d,) = w.queue.read(w.worker_id, 10)
    w.deliveries.begin_deliveries([job_id], w.worker_id, 3, time.time())
    w.results.add(Outcome(job_id, JobStatus.SUCCEEDED, time.time(),
                          result=JobResult(text="done"), stats=JobStats()), d)
    w.results.backoff.failed(time.time())  # e.g. a failed store attempt just before the stop
    w._hand_back()
    info = client.get(job_id)
    assert (info.status, info.result.text, info.attempts) == (JobStatus.SUCCEEDED, "done", 1)
    assert w.queue.depth() == (0, 0)
