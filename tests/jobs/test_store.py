from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from pydantic import ValidationError
from services import all_roles_store

from jobs.constants import MAX_PAYLOAD_BYTES
from jobs.schemas import JobResult, JobSpec, JobStats, JobStatus, Outcome, decode_job, encode_job
from jobs.store import Decision

SQL = all_roles_store()


def _spec(i: int = 0, **kw) -> JobSpec:  # type: ignore[no-untyped-def]
    return JobSpec(model="m", prompt=f"prompt {i}", **kw)


def test_schema_round_trip_and_validation() -> None:
    spec = JobSpec(model="m", messages=[{"role": "user", "content": "hi"}],
                   sampling={"temperature": 0.0, "max_tokens": 4}, metadata={"k": [1, 2]})
    assert decode_job(encode_job(spec)) == spec
    assert spec.engine_prompt(chat=True) == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValidationError, match="exactly one"):
        JobSpec(model="m")
    with pytest.raises(ValidationError, match="exactly one"):
        JobSpec(model="m", prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValidationError, match=r"sampling\.temprature\n.*Unexpected keyword"):
        JobSpec(model="m", prompt="a", sampling={"temprature": 0.5})
    with pytest.raises(ValidationError, match=r"temperature must be >= 0\.0, got -1\.0"):
        JobSpec(model="m", prompt="a", sampling={"temperature": -1})
    with pytest.raises(ValueError, match="limit"):
        encode_job(JobSpec(model="m", prompt="x" * MAX_PAYLOAD_BYTES))
    with pytest.raises(ValueError):
        decode_job(b"not json")
    assert JobStatus("expired").terminal and not JobStatus.RUNNING.terminal


def test_wire_json_is_made_once_and_follows_model_copy() -> None:
    spec = JobSpec(model="m", prompt="héllo", metadata={"k": [1, 2]})
    assert encode_job(spec) is spec.wire_json  # the validator made it; nothing makes it again
    assert json.loads(spec.wire_json) == spec.model_dump(mode="json")
    assert "wire_json" not in spec.model_dump() and decode_job(spec.wire_json) == spec
    other = spec.model_copy(update={"prompt": "other"})
    assert json.loads(encode_job(other))["prompt"] == "other"  # not the copied JSON
    assert spec.model_copy() == spec and spec.model_copy().wire_json == spec.wire_json


def test_store_behind_raises_a_chunk_failure_and_stores_the_chunk_in_flight(
        redis_client, keys, sql_engine: sa.Engine) -> None:  # type: ignore[no-untyped-def]
    from jobs.client import JobClient

    client = JobClient(redis_client, sql_engine, key_prefix=keys.prefix)
    first = [_spec(i, batch_id="b", custom_id=f"r{i}") for i in range(3)]
    again = [_spec(9, batch_id="b", custom_id="r0")]  # (batch_id, custom_id) is taken
    with pytest.raises(sa.exc.IntegrityError), client.store_behind():
        client.store(first)
        client.store(again)  # stored by the thread, after ``first``; fails there
    assert client.count_by_status("b") == {JobStatus.QUEUED: 3}

    later = [_spec(i, batch_id="b", custom_id=f"r{i}") for i in range(3, 6)]
    with pytest.raises(sa.exc.IntegrityError), client.store_behind():
        client.store(again)
        client.store(later)  # raises the failure before it: ``later`` is not stored
    assert client.count_by_status("b") == {JobStatus.QUEUED: 3}

    with pytest.raises(KeyboardInterrupt), client.store_behind():
        client.store(later)
        raise KeyboardInterrupt  # leaving on an error: the chunk handed over is stored
    assert client.count_by_status("b") == {JobStatus.QUEUED: 6}
    client.store([_spec(7)])  # outside the block: at once, in this thread
    assert sum(client.count_by_status().values()) == 7


def test_deliveries_count_attempts_and_dead_letter_past_limit(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    spec = _spec()
    store.insert_jobs([spec])
    now = time.time()
    for attempt in (1, 2):
        assert store.begin_deliveries([spec.id], "w1", max_deliveries=2, now_s=now) == {
            spec.id: Decision.RUN
        }
        assert store.get(spec.id).attempts == attempt
    assert store.begin_deliveries([spec.id], "w2", 2, now) == {spec.id: Decision.DEAD}
    info = store.get(spec.id)
    assert info.status is JobStatus.FAILED and "dead-lettered" in info.error
    assert info.stats is not None  # every terminal job has its metrics row
    assert store.begin_deliveries([spec.id], "w3", 2, now) == {spec.id: Decision.SKIP}
    assert store.begin_deliveries(["unknown"], "w3", 2, now) == {"unknown": Decision.SKIP}


def test_exactly_one_terminal_transition(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    spec = _spec()
    store.insert_jobs([spec])
    store.begin_deliveries([spec.id], "w1", 3, time.time())
    result = JobResult(text="hello", token_ids=[1, 2], finish_reason="length")
    stats = JobStats(ttft_s=0.5, prompt_tokens=7, generated_tokens=2, peak_kv_blocks=1)
    first = Outcome(spec.id, JobStatus.SUCCEEDED, time.time(), result=result, stats=stats)
    assert store.finish([first], worker_id="w1") == {spec.id}
    dup = Outcome(spec.id, JobStatus.FAILED, time.time(), error="late duplicate")
    assert store.finish([dup], worker_id="w2") == set()
    info = store.get(spec.id)
    assert (info.status, info.worker_id, info.error) == (JobStatus.SUCCEEDED, "w1", None)
    assert info.result.text == "hello" and info.result.usage.prompt_tokens == 7
    with sql_engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT job_id, status, ttft_s FROM job_stats")).all()
    assert [tuple(r) for r in rows] == [(spec.id, "succeeded", 0.5)]


def test_many_outcomes_in_one_batch_each_stored_once(sql_engine: sa.Engine) -> None:
    """A worker's batch of outcomes of every shape (results with logprobs and choices,
    failures, a job already ended, one named twice) in one ``finish``: each job ends once,
    with exactly its own values."""
    from jobs.schemas import Choice, TokenLogprob, TopLogprob

    store = SQL(sql_engine)
    specs = [_spec(i) for i in range(5)]
    store.insert_jobs(specs)
    ids = [s.id for s in specs]
    store.begin_deliveries(ids, "w1", 3, time.time())
    top = TopLogprob(token="h\u00e9", token_id=7, logprob=-0.25, bytes=[104, 195, 169])
    rich = JobResult(text="h\u00e9 \u2603", token_ids=[7, 8], finish_reason="stop",
                     logprobs=[TokenLogprob(**top.model_dump(), top_logprobs=[top])],
                     choices=[Choice(index=0, text="a", token_ids=[1], finish_reason="stop"),
                              Choice(index=1, text="b", token_ids=[2], finish_reason="length")])
    assert store.finish([Outcome(ids[4], JobStatus.FAILED, time.time(), error="earlier")],
                        worker_id="w0") == {ids[4]}
    now = time.time()
    outcomes = [
        Outcome(ids[0], JobStatus.SUCCEEDED, now, result=rich, stats=JobStats(prompt_tokens=3)),
        Outcome(ids[1], JobStatus.SUCCEEDED, now, result=JobResult(text="", token_ids=[]),
                stats=JobStats()),
        Outcome(ids[2], JobStatus.FAILED, now, error="bad \u2603 input"),
        Outcome(ids[2], JobStatus.SUCCEEDED, now, result=JobResult(text="second copy")),
        Outcome(ids[3], JobStatus.CANCELLED, now, error="cancelled"),
        Outcome(ids[4], JobStatus.SUCCEEDED, now, result=JobResult(text="too late")),
    ]
    assert store.finish(outcomes, worker_id="w1") == set(ids[:4])
    infos = {i.id: i for i in store.get_many(ids)}
    assert infos[ids[0]].result == rich.model_copy(update={"usage": infos[ids[0]].result.usage})
    assert infos[ids[0]].stats.prompt_tokens == 3 and infos[ids[0]].worker_id == "w1"
    assert (infos[ids[1]].status, infos[ids[1]].result.text) == (JobStatus.SUCCEEDED, "")
    assert (infos[ids[2]].status, infos[ids[2]].error) == (JobStatus.FAILED, "bad \u2603 input")
    assert infos[ids[3]].status is JobStatus.CANCELLED
    assert (infos[ids[4]].status, infos[ids[4]].error, infos[ids[4]].worker_id) == (
        JobStatus.FAILED, "earlier", "w0")
    with sql_engine.connect() as conn:
        per_job = dict(conn.execute(sa.text(
            "SELECT job_id, count(*) FROM job_metrics GROUP BY job_id")).all())
    assert per_job == dict.fromkeys(ids, 1)


def test_cancel_deadline_release_and_batches(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    now = time.time()
    queued, running, late = _spec(1), _spec(2), _spec(3, deadline=datetime.now(UTC)
                                                       - timedelta(seconds=1))
    batched = [_spec(10 + i, batch_id="b1", custom_id=f"row-{i}") for i in range(3)]
    store.insert_jobs([queued, running, late, *batched])
    assert store.count_by_status(batch_id="b1") == {JobStatus.QUEUED: 3}
    with pytest.raises(sa.exc.IntegrityError):  # custom ids are unique within a batch
        store.insert_jobs([_spec(99, batch_id="b1", custom_id="row-0")])

    assert store.request_cancel(queued.id, now) is JobStatus.CANCELLED
    assert store.begin_deliveries([queued.id], "w", 3, now) == {queued.id: Decision.SKIP}

    assert store.begin_deliveries([running.id], "w", 3, now) == {running.id: Decision.RUN}
    assert store.request_cancel(running.id, now) is JobStatus.RUNNING  # the worker aborts it
    assert store.get(running.id).status is JobStatus.RUNNING
    assert store.release([running.id], "w") == 1  # hand-back gives the attempt back
    info = store.get(running.id)
    assert (info.status, info.attempts, info.worker_id) == (JobStatus.QUEUED, 0, None)
    # A redelivered job whose cancel was requested is not run.
    assert store.begin_deliveries([running.id], "w", 3, now) == {running.id: Decision.CANCELLED}

    assert store.expire_past_deadline(now, model="m") == [(late.id, JobStatus.QUEUED.value)]
    assert store.get(late.id).status is JobStatus.EXPIRED
    assert store.request_cancel("nope", now) is None


def test_copy_of_job_running_on_live_worker_is_skipped(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    spec = JobSpec(model="m", prompt="p")
    store.insert_jobs([spec])
    now = time.time()
    assert store.begin_deliveries([spec.id], "w1", 2, now) == {spec.id: Decision.RUN}
    for _ in range(3):  # stolen-lease or reconciler copies while w1 is alive
        assert store.begin_deliveries([spec.id], "w2", 2, now, live_workers={"w1", "w2"}) == {
            spec.id: Decision.SKIP}
    (info,) = store.get_many([spec.id])
    assert (info.status, info.attempts, info.worker_id) == (JobStatus.RUNNING, 1, "w1")
    # w1 is gone: the next delivery takes the job over.
    assert store.begin_deliveries([spec.id], "w2", 2, now, live_workers={"w2"}) == {
        spec.id: Decision.RUN}
    assert store.get(spec.id).worker_id == "w2"


def test_dead_lettered_job_attempts_match_its_error(sql_engine: sa.Engine) -> None:
    store = SQL(sql_engine)
    spec = JobSpec(model="m", prompt="p")
    store.insert_jobs([spec])
    for worker in ("w1", "w2"):
        store.begin_deliveries([spec.id], worker, 2, time.time())
    assert store.begin_deliveries([spec.id], "w3", 2, time.time()) == {spec.id: Decision.DEAD}
    info = store.get(spec.id)
    assert info.attempts == 3 and "delivered 3 times" in info.error


def test_payload_limit_counts_utf8_bytes() -> None:
    spec_json = json.dumps({"model": "m", "prompt": "é" * (MAX_PAYLOAD_BYTES // 2 + 10)},
                           ensure_ascii=False)  # fewer characters than the limit, more bytes
    assert len(spec_json) < MAX_PAYLOAD_BYTES < len(spec_json.encode())
    with pytest.raises(ValueError, match="byte limit"):
        decode_job(spec_json)
