"""Bad input, property-based (hypothesis): arbitrary bytes and JSON straight into the stream,
arbitrary values through the SDK and through the JSONL parser of ``kvbatch submit``. Each input
is refused at submission with a clear error, or its job ends failed with a readable reason;
the worker survives and other jobs are unaffected. ``KVBATCH_SOAK=1`` tries 10x more inputs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import redis
import sqlalchemy as sa
from chaos import MODEL, REPO, wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from services import SOAK, all_roles_store
from test_faults import record

from jobs.client import JobClient
from jobs.constants import FIELD_ID, FIELD_JOB, Keys
from jobs.queue import JobQueue
from jobs.rows import SAMPLING_FIELDS, parse_row
from jobs.sdk import Client, row_spec

SQL = all_roles_store()

EXAMPLES = 1500 if SOAK else 150
FAST = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=50),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10),
                                                                      children, max_size=4),
    max_leaves=12)
sampling_values = st.dictionaries(
    st.sampled_from([*sorted(SAMPLING_FIELDS), "temprature", "best_of"]),
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats()
    | st.sampled_from([math.nan, math.inf, -1.0, 1e308]) | st.text(max_size=5)
    | st.lists(st.integers(-5, 60_000), max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    max_size=5)
prompts = st.one_of(st.text(max_size=200), st.just(""), st.text(alphabet="😀é\u0000\ufffd\u202e",
                                                              max_size=50),
                    st.just("x" * 3000))  # over the 256-token context of the test worker


def _canary(client: JobClient, keys: Keys) -> None:
    from jobs.schemas import JobSpec

    (job_id,) = client.submit([JobSpec(model=MODEL, prompt="canary",
                                       sampling={"temperature": 0.0, "max_tokens": 4})])
    (info,) = client.wait([job_id], timeout_s=60)
    assert info.status.value == "succeeded", info.error


def test_arbitrary_stream_entries(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                                  workers) -> None:  # type: ignore[no-untyped-def]
    worker = workers.start("fuzzed", max_model_len=256)
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    _canary(client, keys)
    q = JobQueue(redis_client, MODEL, keys)
    raw = redis.Redis.from_url("redis://127.0.0.1:6379/0")  # bytes, not decoded
    tried: list[str] = []

    @FAST
    @given(payload=st.binary(max_size=300) | json_values.map(json.dumps).map(str.encode),
           with_row=st.booleans(), id_field=st.none() | st.text(max_size=80))
    def push(payload: bytes, with_row: bool, id_field: str | None) -> None:
        from jobs.schemas import JobSpec

        fields: dict[bytes, bytes] = {FIELD_JOB.encode(): payload}
        if with_row:  # a real job whose stream copy is garbage: it must fail, readably
            spec = JobSpec(model=MODEL, prompt="p")
            SQL(client.engine).insert_jobs([spec])
            fields[FIELD_ID.encode()] = spec.id.encode()
            tried.append(spec.id)
        elif id_field is not None:
            fields[FIELD_ID.encode()] = id_field.encode("utf-8", "surrogatepass")
        raw.xadd(q.streams[0], fields)

    push()
    raw.close()
    wait_until(lambda: q.depth() == (0, 0) or not worker.alive(), 120, what="stream drained")
    assert worker.alive(), worker.log()[-3000:]
    infos = client.wait(tried, timeout_s=60)
    assert all(i.status.value == "failed" and i.error for i in infos), [
        (i.status, i.error) for i in infos if i.status.value != "failed"]
    assert worker.alive(), worker.log()[-3000:]
    _canary(client, keys)
    record("bad_input_stream", inputs=EXAMPLES, with_sql_row=len(tried), worker_survived=True)


def test_arbitrary_sdk_arguments(redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine,
                                 pg_url: str, workers) -> None:  # type: ignore[no-untyped-def]
    from services import REDIS_URL

    worker = workers.start("sdk-fuzzed", max_model_len=256)
    refused: list[str] = []
    accepted: list[str] = []
    with Client(REDIS_URL, pg_url, key_prefix=keys.prefix, model=MODEL) as sdk:

        @FAST
        @example(prompt="", sampling={"temperature": math.inf}, priority=0, metadata=None)
        @given(prompt=prompts, sampling=sampling_values,
               priority=st.integers(-(2**40), 2**40) | st.text(max_size=3),
               metadata=st.none() | st.dictionaries(st.text(max_size=5), json_values,
                                                    max_size=3))
        def submit(prompt, sampling, priority, metadata) -> None:  # type: ignore[no-untyped-def]
            try:
                job = sdk.submit(prompt, priority=priority, metadata=metadata, **sampling)
            except (ValidationError, ValueError, TypeError) as exc:
                assert str(exc).strip()
                refused.append(type(exc).__name__)
                return
            accepted.append(job.id)

        submit()
        client = sdk.jobs
        wait_until(lambda: len(SQL(client.engine).terminal_ids(accepted)) == len(accepted), 300,
                   interval_s=0.5, what="accepted jobs terminal")
        infos = client.get_many(accepted)
    for info in infos:
        assert info.status.value in ("succeeded", "failed"), info
        if info.status.value == "failed":
            assert info.error and len(info.error) < 2000, info.error
    assert worker.alive(), worker.log()[-3000:]
    _canary(JobClient(redis_client, pg_engine, key_prefix=keys.prefix), keys)
    failed = sum(1 for i in infos if i.status.value == "failed")
    record("bad_input_sdk", inputs=EXAMPLES, refused_at_submission=len(refused),
           accepted=len(accepted), failed_with_reason=failed, worker_survived=True)


def test_arbitrary_jsonl_rows() -> None:
    counted = [0]

    @settings(max_examples=EXAMPLES * 10, deadline=None, database=None)
    @given(obj=json_values | st.dictionaries(
        st.sampled_from(["custom_id", "prompt", "messages", "metadata", "priority", "body",
                         "url", "method", "max_tokens", "temperature", "stop"]),
        json_values, max_size=5), system=st.none() | st.text(max_size=5))
    def parse(obj, system) -> None:  # type: ignore[no-untyped-def]
        counted[0] += 1
        try:
            row = parse_row(obj, 0)
            spec = row_spec(row, model=MODEL, batch_id="b", system_prompt=system, defaults={},
                            priority=0, deadline=None)
        except ValueError as exc:  # pydantic's ValidationError is one
            assert str(exc).strip()
            return
        assert spec.model == MODEL

    parse()
    record("bad_input_jsonl", inputs=counted[0])


def test_kvbatch_submit_refuses_a_bad_file_by_line(tmp_path: Path, pg_url: str,
                                                   keys: Keys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "prompt": "fine"}\n{"custom_id": "b", "prompt": 5, '
                   '"metadata": 7}\n', encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "submit", str(bad), "-o", str(tmp_path / "out.jsonl"),
         "--model", MODEL, "--strict", "--database-url", pg_url, "--key-prefix", keys.prefix],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "bad.jsonl:2" in out.stderr and "Traceback" not in out.stderr, out.stderr
