"""Hardening against poison jobs and oversized asks, on a live in-thread worker: a bad job
fails alone with a reason naming what is wrong; its neighbours run once and succeed."""

from __future__ import annotations

import json
import re

import pytest
import redis
import sqlalchemy as sa

from jobs.client import JobClient
from jobs.constants import FIELD_ID, FIELD_JOB, Keys
from jobs.queue import JobQueue
from jobs.schemas import JobSpec, JobStatus

MODEL = "tiny"
OUTSIDE_VOCAB = 100_000  # the tiny model's byte tokenizer has a few hundred tokens


def _job(i: int, **sampling: object) -> JobSpec:
    return JobSpec(model=MODEL, prompt=f"job {i}",
                   sampling={"temperature": 0.0, "max_tokens": 6, **sampling})


def _inject(redis_client: redis.Redis, keys: Keys, client: JobClient, spec: JobSpec,
            **raw: object) -> None:
    """Store ``spec`` as a producer would, then put a different payload on the stream: what a
    client that skips the SDK's checks could send."""
    client.producer.insert_jobs([spec])
    payload = {**spec.model_dump(mode="json"), **raw}
    redis_client.xadd(JobQueue(redis_client, MODEL, keys).streams[0],
                      {FIELD_ID: spec.id, FIELD_JOB: json.dumps(payload)})


def test_one_poison_job_among_fifty_fails_alone(redis_client: redis.Redis, keys: Keys,
                                                pg_engine: sa.Engine, start_worker) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    good = [_job(i) for i in range(49)]
    # Passes every rule that needs no model (the vocabulary is the worker's to know), then
    # made the sampler index past the vocabulary and took the whole step down.
    poison = _job(99, stop_token_ids=[OUTSIDE_VOCAB], min_tokens=1)
    ids = client.submit([*good[:25], poison, *good[25:]])
    overflow = _job(100)  # top_k 2**63 overflowed in the sampler; refused when decoded now
    _inject(redis_client, keys, client, overflow,
            sampling={"temperature": 0.0, "max_tokens": 6, "top_k": 2**63})
    running = start_worker(max_model_len=256)
    infos = {i.id: i for i in client.wait([*ids, overflow.id], timeout_s=120)}
    for spec in good:
        info = infos[spec.id]
        assert info.status is JobStatus.SUCCEEDED and info.attempts == 1, (info.status,
                                                                         info.error)
    assert infos[poison.id].status is JobStatus.FAILED and infos[poison.id].attempts == 1
    assert f"stop_token_ids [{OUTSIDE_VOCAB}] are outside the vocabulary" in infos[poison.id].error
    assert infos[overflow.id].status is JobStatus.FAILED
    assert "top_k must be in [0, 2147483647]" in infos[overflow.id].error
    assert running.thread.is_alive() and running.rc is None  # the worker keeps serving


def test_a_job_that_breaks_the_step_on_a_live_worker_fails_alone(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker) -> None:  # type: ignore[no-untyped-def]
    """Whatever passes every check and still makes the step raise (here: the forward raises
    whenever this job's rows are in it): the engine bisects the step, the job fails alone with
    the error, its 49 neighbours run once, and the worker keeps serving."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    good = [_job(i) for i in range(49)]
    poison = _job(99)

    def poisoned(engine):  # type: ignore[no-untyped-def]
        run = engine.runner.run

        def run_failing_for_poison(batch):  # type: ignore[no-untyped-def]
            if any(s.seq.request_id == poison.id for s in batch.seqs):
                raise IndexError("index 49152 is out of bounds for dimension 1")
            return run(batch)

        engine.runner.run = run_failing_for_poison
        return engine

    ids = client.submit([*good[:30], poison, *good[30:]])
    running = start_worker(engine_wrapper=poisoned, max_model_len=256)
    infos = {i.id: i for i in client.wait(ids, timeout_s=120)}
    assert all(infos[s.id].status is JobStatus.SUCCEEDED and infos[s.id].attempts == 1
               for s in good)
    assert infos[poison.id].status is JobStatus.FAILED and infos[poison.id].attempts == 1
    assert "failed in the engine step: IndexError: index 49152" in infos[poison.id].error
    assert running.thread.is_alive() and running.rc is None


def test_oversized_asks_are_refused_at_submission(redis_client: redis.Redis, keys: Keys,
                                                  pg_engine: sa.Engine) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    cases = [
        # a 447-byte request once stored a 10.7 MB result
        (_job(0, n=8, temperature=1.0, max_tokens=2000, logprobs=20), "KVBATCH_MAX_RESULT_BYTES"),
        (_job(1, n=2, temperature=1.0, max_tokens=40_000), "n x max_tokens is 80000"),
        (_job(2, stop=[f"s{i}" for i in range(10_000)]), "stop has 10000 strings"),
        (_job(3, stop=["x" * 300]), "300 characters"),
        (JobSpec(model=MODEL, prompt="p" * (600 * 1024)), "prompt is 614400 bytes"),
    ]
    for spec, reason in cases:
        with pytest.raises(ValueError, match=reason):
            client.submit([spec])
    assert client.count_by_status() == {}


def test_the_worker_enforces_the_limits_too(redis_client: redis.Redis, keys: Keys,
                                            pg_engine: sa.Engine, start_worker,  # type: ignore[no-untyped-def]
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    big_prompt = _job(0)
    _inject(redis_client, keys, client, big_prompt, prompt="p" * (600 * 1024))
    wordy = _job(1, n=4, temperature=1.0, max_tokens=32, ignore_eos=True)
    fine = _job(2)
    ids = client.submit([wordy, fine])  # within the producer's limits
    monkeypatch.setenv("KVBATCH_MAX_RESULT_BYTES", "1024")  # a stricter worker
    start_worker(max_model_len=256)
    infos = {i.id: i for i in client.wait([*ids, big_prompt.id], timeout_s=120)}
    assert infos[big_prompt.id].status is JobStatus.FAILED
    assert "prompt is 614400 bytes, over the limit" in infos[big_prompt.id].error
    assert infos[wordy.id].status is JobStatus.FAILED and infos[wordy.id].result is None
    assert re.match(r"result is \d+ bytes, over the limit of 1024 \(KVBATCH_MAX_RESULT_BYTES\)",
                    infos[wordy.id].error)
    assert infos[wordy.id].stats.generated_tokens == 4 * 32  # the work is still accounted
    assert infos[fine.id].status is JobStatus.SUCCEEDED


def test_a_schema_too_deep_for_the_worker_fails_alone(redis_client: redis.Redis, keys: Keys,
                                                      pg_engine: sa.Engine, start_worker) -> None:  # type: ignore[no-untyped-def]
    """Sent past the SDK's checks, a schema nested ~100 levels once raised RecursionError in the
    worker's intake: the worker died, the delivery was never counted, and the next worker died
    on it too. It is refused when decoded, and the worker serves on."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    deep = _job(0)
    schema: dict = {"type": "string"}
    for _ in range(90):  # past the limit, within the JSON parser's
        schema = {"type": "object", "properties": {"a": schema}}
    _inject(redis_client, keys, client, deep, sampling={
        "max_tokens": 6, "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "d", "schema": schema}}})
    fine = _job(1)
    ids = client.submit([fine])
    running = start_worker(max_model_len=256)
    infos = {i.id: i for i in client.wait([*ids, deep.id], timeout_s=120)}
    assert infos[deep.id].status is JobStatus.FAILED and infos[deep.id].attempts <= 1
    assert "malformed job message" in infos[deep.id].error
    assert "nested more than 64 levels" in infos[deep.id].error
    assert infos[fine.id].status is JobStatus.SUCCEEDED
    assert running.thread.is_alive() and running.rc is None


def test_schema_bombs_sent_past_the_sdk_fail_fast_beside_healthy_jobs(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, start_worker) -> None:  # type: ignore[no-untyped-def]
    """A 1,500-property nested-repeat schema and a 150-deep one (each refused at submission)
    put straight on the stream, then 30 healthy jobs: the bombs end failed with their reasons
    when decoded, before any compile, and the healthy jobs all succeed on the same worker."""
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    wide = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "((a{31}){31}){31}"} for i in range(1500)}}
    deep: dict = {"type": "string"}
    for _ in range(150):
        deep = {"type": "object", "properties": {"a": deep}}
    bombs = [_job(900 + i) for i in range(2)]
    for bomb, schema in zip(bombs, (wide, deep), strict=True):
        _inject(redis_client, keys, client, bomb, sampling={
            "max_tokens": 6, "response_format": {
                "type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}})
    healthy = [_job(i) for i in range(30)]
    ids = client.submit(healthy)
    running = start_worker(max_model_len=256)
    infos = {i.id: i for i in client.wait([*ids, *(b.id for b in bombs)], timeout_s=120)}
    assert "MAX_SCHEMA_PROPERTIES" in infos[bombs[0].id].error
    assert infos[bombs[1].id].status is JobStatus.FAILED and "malformed job message" in (
        infos[bombs[1].id].error)  # past the depth limit, or the JSON parser's own
    assert all(infos[i].status is JobStatus.SUCCEEDED for i in ids)
    assert infos[bombs[0].id].status is JobStatus.FAILED
    assert running.thread.is_alive() and running.rc is None
