"""Row formats, output shapes and statistics: tables of inputs, plus stats on both databases."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from services import all_roles_store

from jobs import db
from jobs.rows import ENGINE_FAULT, RowKind, output_line, parse_row
from jobs.schemas import JobInfo, JobResult, JobSpec, JobStats, JobStatus, Outcome, Usage
from jobs.stats import aggregate, percentiles

SQL = all_roles_store()

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(("row", "expected"), [
    ({"prompt": "hi"}, ("7", RowKind.PLAIN, "hi", None, {})),
    ({"custom_id": 3, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
      "stop": ["\n"]}, ("3", RowKind.PLAIN, None, [{"role": "user", "content": "x"}],
                        {"max_tokens": 4, "stop": ["\n"]})),
    ({"custom_id": "a", "method": "POST", "url": CHAT,
      "body": {"model": "gpt-4o", "max_completion_tokens": 9, "stop": "END", "logprobs": True,
               "top_logprobs": 2, "messages": [{"role": "user", "content": [
                   {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}},
     ("a", RowKind.CHAT, None, [{"role": "user", "content": "ab"}],
      {"max_tokens": 9, "stop": ["END"], "logprobs": 2})),
    ({"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "p", "logprobs": 1}},
     ("b", RowKind.COMPLETION, "p", None, {"logprobs": 1})),
    ({"custom_id": "c", "url": CHAT, "body": {
        "messages": [], "logit_bias": {"9": -100}, "top_k": 5,
        "response_format": {"type": "json_object"}}},
     ("c", RowKind.CHAT, None, [], {"logit_bias": {"9": -100}, "top_k": 5,
                                     "response_format": {"type": "json_object"}})),
    ({"raw_prompt": "q", "response_format": {"type": "regex", "regex": "a+"}},
     ("7", RowKind.PLAIN, "q", None, {"response_format": {"type": "regex", "regex": "a+"}})),
])
def test_parse_row(row, expected) -> None:  # type: ignore[no-untyped-def]
    r = parse_row(row, 7)
    # a plain prompt / raw prompt and an OpenAI completions prompt (raw text)
    prompt = r.raw_prompt if r.raw_prompt is not None else r.prompt
    assert (r.custom_id, r.kind, prompt, r.messages, r.sampling) == expected
    assert r.kind is not RowKind.COMPLETION or r.prompt is None


@pytest.mark.parametrize(("row", "message"), [
    ([1, 2], "JSON object"),
    ({"prompt": "x", "colour": 1}, "unknown field"),
    ({"url": CHAT, "body": {}}, "needs a 'custom_id'"),
    ({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}, "POST only"),
    ({"custom_id": "a", "url": "/v1/moderations", "body": {}}, "not supported"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {}}, "'input' must be a string"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": [1, 2]}}, "list of strings"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x", "n": 2}}, "'n'"),
    ({"custom_id": "a", "url": CHAT, "body": {"tools": []}}, "'tools'"),
    ({"custom_id": "a", "url": CHAT, "body": {"messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}}, "text content parts"),
])
def test_parse_row_errors(row, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        parse_row(row, 0)


def _info(status: JobStatus, **kw) -> JobInfo:  # type: ignore[no-untyped-def]
    now = datetime.now(UTC)
    return JobInfo(id="j1", batch_id="b", custom_id="c1", model="m", status=status,
                   priority=0, metadata={}, created_at=now, started_at=now, finished_at=now,
                   deadline=None, attempts=1, worker_id="w", **kw)


def test_rows_of_the_same_sampling_share_one_validated_sampling_params() -> None:
    from pydantic import ValidationError

    from jobs.sdk import row_spec

    known: dict = {}

    def spec(row: dict) -> JobSpec:
        return row_spec(parse_row(row, 0), model="m", batch_id=None, system_prompt=None,
                        defaults={"max_tokens": 4}, priority=0, deadline=None, sampling=known)

    a, b = spec({"prompt": "a"}), spec({"prompt": "b"})
    assert a.sampling is b.sampling and a.sampling.max_tokens == 4
    c, d = spec({"prompt": "c", "top_k": 3}), spec({"prompt": "d", "top_k": 3})
    assert c.sampling is d.sampling and c.sampling.top_k == 3 and c.sampling.max_tokens == 4
    assert spec({"prompt": "e", "max_tokens": 9}).sampling.max_tokens == 9
    for _ in range(2):  # a refused row is not kept: refused each time, with its field named
        with pytest.raises(ValidationError, match="temperature must be >= 0"):
            spec({"prompt": "f", "temperature": -1})
    with pytest.raises(ValidationError, match="top_k"):  # a value of another type: its own
        spec({"prompt": "g", "top_k": "3 tokens"})
    stop = spec({"prompt": "h", "stop": ["\n"]})  # a list is not a key: validated each time
    assert stop.sampling.stop == ("\n",) and spec({"prompt": "i", "stop": ["x"]}).sampling.stop \
        == ("x",)


def test_output_shapes() -> None:
    ok = _info(JobStatus.SUCCEEDED, error=None, stats=JobStats(e2e_s=1.5), result=JobResult(
        text="hello", token_ids=[1, 2], finish_reason="length",
        usage=Usage(prompt_tokens=10, cached_prompt_tokens=8, completion_tokens=2)))
    line = output_line(RowKind.CHAT, ok)
    body = line["response"]["body"]
    assert line["custom_id"] == "c1" and line["error"] is None
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 8}}
    assert output_line(RowKind.COMPLETION, ok)["response"]["body"]["choices"][0]["text"] == "hello"
    plain = output_line(RowKind.PLAIN, ok)
    assert plain["text"] == "hello" and plain["status"] == "succeeded" and plain["e2e_s"] == 1.5
    expired = _info(JobStatus.EXPIRED, error="deadline passed")
    line = output_line(RowKind.CHAT, expired)
    assert line["response"] is None
    assert line["error"] == {"code": "batch_expired", "message": "deadline passed"}
    assert output_line(RowKind.PLAIN, expired)["error"] == "deadline passed"
    cancelled = output_line(RowKind.COMPLETION, _info(JobStatus.CANCELLED, error="cancelled"))
    assert cancelled["error"]["code"] == "batch_cancelled"
    failed = output_line(RowKind.CHAT, _info(JobStatus.FAILED, error="prompt is empty"))
    assert failed["error"] is None and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["message"] == "prompt is empty"
    fault = output_line(RowKind.CHAT, _info(JobStatus.FAILED, error=f"{ENGINE_FAULT}: boom"))
    assert fault["response"]["status_code"] == 500
    assert fault["response"]["body"]["error"]["type"] == "server_error"
    # old results (logprobs without token texts) still read
    legacy = JobResult.model_validate({"text": "ab", "token_ids": [5, 6],
                                       "logprobs": [{"5": -0.1, "9": -0.5}, {"6": -2.0}]})
    assert [lp.token_id for lp in legacy.logprobs or []] == [5, 6]
    assert [t.token_id for t in (legacy.logprobs or [])[0].top_logprobs] == [5, 9]


def test_percentiles() -> None:
    assert percentiles([None, 3.0, 1.0, 2.0, 4.0]) == {"p50": 2.5, "p90": 3.7,
                                                        "p99": pytest.approx(3.97)}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_stats_by_batch_and_since(database: str, request: pytest.FixtureRequest,
                                  tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = (request.getfixturevalue("pg_url") if database == "postgresql"
           else f"sqlite:///{tmp_path / 'stats.db'}")
    engine = db.make_engine(url)
    db.upgrade(engine)
    store = SQL(engine)
    t0 = time.time()  # created_at is the database's clock at insert, just after t0
    specs = [JobSpec(id=uuid.uuid4().hex, model="m", prompt="p", batch_id=b, custom_id=str(i))
             for i, b in enumerate(["x", "x", "y"])]
    store.insert_jobs(specs)
    stats = [JobStats(e2e_s=e, prompt_tokens=100, cached_prompt_tokens=c, generated_tokens=g,
                      peak_kv_bytes=k) for e, c, g, k in [(1.0, 50, 10, 4096),
                                                          (3.0, 0, 30, 8192), (2.0, 0, 5, 1)]]
    store.finish([Outcome(s.id, JobStatus.SUCCEEDED, t0 + 10, result=JobResult(), stats=st)
                  for s, st in zip(specs, stats, strict=True)])
    x = aggregate(SQL(engine).job_stats_rows(batch_id="x"))
    assert (x.jobs, x.generated_tokens, x.cached_prompt_tokens, x.peak_kv_bytes) == (
        2, 40, 50, 8192)
    assert x.prefix_cache_hit_rate == 0.25 and x.e2e_s["p50"] == 2.0
    assert x.wall_s == pytest.approx(10, abs=0.5)
    assert x.output_tokens_per_s == pytest.approx(40 / x.wall_s)
    reader = SQL(engine)
    assert aggregate(reader.job_stats_rows(since=timedelta(hours=1))).jobs == 3
    soon = datetime.now(UTC) + timedelta(minutes=1)
    assert aggregate(reader.job_stats_rows(since=soon)).jobs == 0
    y_last_hour = reader.job_stats_rows(batch_id="y", since=timedelta(hours=1))
    assert aggregate(y_last_hour).generated_tokens == 5
    engine.dispose()
