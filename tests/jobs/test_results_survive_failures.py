"""What a worker owes outlives a failure: acks, dead letters and notices Redis did not take
stay in the outbox until it does; a result the database refuses in every form is stored bare
(or given up on) without blocking the others."""

from __future__ import annotations

import time

import pytest
import redis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.retry import Retry
from worker_harness import bare_worker

from jobs.client import JobClient
from jobs.constants import Keys
from jobs.queue import JobQueue
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome
from worker.outbox import Outbox

MODEL = "tiny"


def test_outbox_keeps_what_redis_did_not_take(redis_client: redis.Redis, keys: Keys) -> None:
    q = JobQueue(redis_client, "m", keys)
    q.ensure_group()
    specs = [JobSpec(model="m", prompt=f"p{i}") for i in range(2)]
    q.enqueue(specs)
    ok, bad = q.read("w", count=2)
    down = redis.Redis(host="127.0.0.1", port=1, decode_responses=True,  # nothing listens
                       socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    outbox = Outbox(JobQueue(down, "m", keys))
    outbox.ack([ok])
    outbox.dead_letter(bad, "unreadable")
    outbox.notify(ok.job_id, "succeeded")
    with pytest.raises(redis.ConnectionError):
        outbox.flush()
    assert outbox and q.depth() == (0, 2)
    outbox.queue = q  # Redis is back
    outbox.flush()
    assert not outbox and q.depth() == (0, 0)
    assert [f["reason"] for _, f in redis_client.xrange(keys.dead_letter("m"))] == ["unreadable"]
    assert redis_client.get(keys.done(ok.job_id)) == "succeeded"


def test_result_refused_in_every_form_is_stored_bare(
    redis_client: redis.Redis, keys: Keys, pg_url: str, pg_engine: sa.Engine, tiny_model: str,
) -> None:
    w = bare_worker(tiny_model, keys, pg_url, pg_engine, redis_client)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    bad, good = JobSpec(model=MODEL, prompt="a"), JobSpec(model=MODEL, prompt="b")
    client.submit([bad, good])
    deliveries = {d.job_id: d for d in w.queue.read(w.worker_id, 10)}
    w.deliveries.begin_deliveries([bad.id, good.id], w.worker_id, 3, time.time())
    huge = JobStats(prompt_tokens=2**40)  # out of range for the integer column
    w.results.add(Outcome(bad.id, JobStatus.SUCCEEDED, time.time(),
                          result=JobResult(text="x"), stats=huge), deliveries[bad.id])
    w.results.add(Outcome(good.id, JobStatus.SUCCEEDED, time.time(),
                          result=JobResult(text="y"), stats=JobStats()), deliveries[good.id])
    w.results.flush()  # stores, then acknowledges
    assert len(w.results) == 0 and not w.results
    infos = {i.id: i for i in client.get_many([bad.id, good.id])}
    assert infos[good.id].status is JobStatus.SUCCEEDED and infos[good.id].result.text == "y"
    assert infos[bad.id].status is JobStatus.FAILED and infos[bad.id].stats is not None
    assert "could not store the result" in infos[bad.id].error
    assert "2199023255552" not in infos[bad.id].error  # no bound parameters in error text
    assert w.queue.depth() == (0, 0)
