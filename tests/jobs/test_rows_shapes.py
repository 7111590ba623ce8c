"""``jobs.rows``: each input shape parsed into its exact ``Row``, each refusal's exact message,
and each output line compared whole (plain, chat, completions, embeddings; succeeded, failed,
expired, cancelled, refused before it ran)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from engine.outputs import FinishReason
from jobs.rows import (
    ENGINE_FAULT,
    Row,
    RowKind,
    output_line,
    parse_row,
    rejected_line,
    rejected_row,
)
from jobs.schemas import (
    Choice,
    JobInfo,
    JobResult,
    JobStats,
    JobStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
FINISHED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


# --- parsing ---------------------------------------------------------------------------------

def test_a_plain_row_keeps_every_field() -> None:
    row = parse_row({"custom_id": "r", "prompt": "hi", "temperature": 0.5, "priority": 3,
                     "metadata": {"k": "v"}, "seed": 1}, 4)
    assert row == Row(custom_id="r", kind=RowKind.PLAIN, prompt="hi",
                      sampling={"temperature": 0.5, "seed": 1}, priority=3,
                      metadata={"k": "v"})
    assert parse_row({"raw_prompt": "x"}, 4) == Row(custom_id="4", kind=RowKind.PLAIN,
                                                   raw_prompt="x")
    messages = [{"role": "user", "content": "a"}]
    assert parse_row({"messages": messages}, 0) == Row(custom_id="0", kind=RowKind.PLAIN,
                                                      messages=messages)


def test_a_plain_row_with_unknown_fields_names_them_sorted() -> None:
    with pytest.raises(ValueError, match=r"^unknown field\(s\) 'a', 'z'$"):
        parse_row({"prompt": "x", "z": 1, "a": 2}, 0)


@pytest.mark.parametrize(("metadata", "message"), [
    ([1], "'metadata' must be a JSON object, not list"),
    ("x", "'metadata' must be a JSON object, not str"),
])
def test_plain_metadata_must_be_an_object(metadata: Any, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_row({"prompt": "x", "metadata": metadata}, 0)
    assert str(e.value) == message


def test_a_chat_row() -> None:
    row = parse_row({"custom_id": 5, "method": "POST", "url": CHAT, "body": {
        "model": "gpt", "user": "u", "store": False, "stream": False, "temperature": 0.0,
        "max_completion_tokens": 3, "stop": "\n", "metadata": {"a": 1},
        "messages": [{"role": "system", "content": "s", "name": "n"},
                     {"role": "user", "content": [{"type": "text", "text": "x"},
                                                  {"type": "text"}]}]}}, 9)
    assert row == Row(custom_id="5", kind=RowKind.CHAT,
                      messages=[{"role": "system", "content": "s"},
                                {"role": "user", "content": "x"}],
                      sampling={"temperature": 0.0, "max_tokens": 3, "stop": ["\n"]},
                      metadata={"a": 1})


@pytest.mark.parametrize(("body", "sampling"), [
    ({"logprobs": True}, {"logprobs": 0}),
    ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
    ({"logprobs": False, "top_logprobs": 3}, {}),
    ({"top_logprobs": 3}, {}),
    ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
    ({"max_tokens": 5, "max_completion_tokens": 7}, {"max_tokens": 7}),
])
def test_chat_sampling(body: dict[str, Any], sampling: dict[str, Any]) -> None:
    row = parse_row({"custom_id": "c", "url": CHAT, "body": body}, 0)
    assert (row.sampling, row.messages, row.metadata) == (sampling, [], {})


@pytest.mark.parametrize(("logprobs", "sampling"), [
    (None, {}), (0, {"logprobs": 0}), (2, {"logprobs": 2}),
])
def test_completions_logprobs_are_a_count(logprobs: Any, sampling: dict[str, Any]) -> None:
    body: dict[str, Any] = {"prompt": "p"}
    if logprobs is not None:
        body["logprobs"] = logprobs
    row = parse_row({"custom_id": "c", "url": COMPLETIONS, "body": body}, 0)
    assert row == Row(custom_id="c", kind=RowKind.COMPLETION, raw_prompt="p", sampling=sampling)


@pytest.mark.parametrize(("body", "embed"), [
    ({"input": "a"}, {"input": ["a"]}),
    ({"input": ["a", "b"], "model": "m", "user": "u"}, {"input": ["a", "b"]}),
    ({"input": ["a"], "dimensions": 4, "encoding_format": "base64"},
     {"input": ["a"], "pooling": {"dimensions": 4}, "encoding_format": "base64"}),
    ({"input": ["a"], "dimensions": None, "encoding_format": None}, {"input": ["a"]}),
])
def test_an_embeddings_row(body: dict[str, Any], embed: dict[str, Any]) -> None:
    row = parse_row({"custom_id": 1, "url": EMBEDDINGS, "body": body}, 0)
    assert row == Row(custom_id="1", kind=RowKind.EMBEDDINGS, embed=embed)


@pytest.mark.parametrize(("obj", "message"), [
    ("x", "a row must be a JSON object"),
    ({"url": CHAT, "body": {}, "extra": 1, "another": 2},
     "unknown field(s) 'another', 'extra'"),
    ({"custom_id": "", "url": CHAT, "body": {}}, "an OpenAI batch row needs a 'custom_id'"),
    ({"custom_id": "a", "method": "PUT", "url": CHAT, "body": {}},
     "method 'PUT' is not supported (POST only)"),
    ({"custom_id": "a", "url": "/v1/x", "body": {}},
     "url '/v1/x' is not supported (/v1/chat/completions, /v1/completions or /v1/embeddings)"),
    ({"custom_id": "a", "body": {}},
     "url None is not supported (/v1/chat/completions, /v1/completions or /v1/embeddings)"),
    ({"custom_id": "a", "url": "plain", "body": {}}, "an OpenAI batch row needs a 'url'"),
    ({"custom_id": "a", "url": CHAT}, "'body' must be an object"),
    ({"custom_id": "a", "url": CHAT, "body": []}, "'body' must be an object"),
    ({"custom_id": "a", "url": CHAT, "body": {"prompt": "p", "tools": []}},
     "body field(s) 'prompt', 'tools' not supported"),
    ({"custom_id": "a", "url": COMPLETIONS, "body": {"messages": []}},
     "body field(s) 'messages' not supported"),
    ({"custom_id": "a", "url": CHAT, "body": {"messages": {"a": 1}}},
     "'messages' must be a list, not dict"),
    ({"custom_id": "a", "url": CHAT, "body": {"messages": ["m"]}},
     "each message must be an object"),
    ({"custom_id": "a", "url": CHAT, "body": {"messages": [{"content": ["t"]}]}},
     "only text content parts are supported"),
    ({"custom_id": "a", "url": CHAT, "body": {"messages": [{"content": [
        {"type": "text", "text": "a"}, {"type": "image_url"}]}]}},
     "only text content parts are supported"),
    ({"custom_id": "a", "url": EMBEDDINGS, "body": {"input": "x", "b": 1, "a": 2}},
     "body field(s) 'a', 'b' not supported"),
    ({"custom_id": "a", "url": EMBEDDINGS, "body": {"input": 3}},
     "'input' must be a string or a list of strings"),
    ({"custom_id": "a", "url": EMBEDDINGS, "body": {"input": ["a", 3]}},
     "'input' must be a string or a list of strings"),
])
def test_refusals_say_exactly_why(obj: Any, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_row(obj, 0)
    assert str(e.value) == message


def test_a_completions_row_keeps_its_metadata() -> None:
    row = parse_row({"custom_id": "c", "url": COMPLETIONS, "body": {
        "prompt": "p", "metadata": {"team": "a"}}}, 0)
    assert row == Row(custom_id="c", kind=RowKind.COMPLETION, raw_prompt="p",
                      metadata={"team": "a"})


def test_a_post_row_and_a_row_without_method_are_accepted() -> None:
    for extra in ({"method": "POST"}, {}):
        row = parse_row({"custom_id": "a", "url": COMPLETIONS, "body": {"prompt": "p"},
                         **extra}, 0)
        assert row.kind is RowKind.COMPLETION and row.raw_prompt == "p"


# --- rows refused before they run ------------------------------------------------------------

@pytest.mark.parametrize(("obj", "row"), [
    ({"prompt": 5, "custom_id": 7}, Row(custom_id="7", kind=RowKind.PLAIN, error="bad")),
    ({"prompt": 5}, Row(custom_id="3", kind=RowKind.PLAIN, error="bad")),
    ({"custom_id": "c", "url": CHAT, "body": 1}, Row(custom_id="c", kind=RowKind.CHAT,
                                                     error="bad")),
    ({"custom_id": "c", "url": "/v1/x"}, Row(custom_id="c", kind=RowKind.CHAT, error="bad")),
    ({"custom_id": "c", "body": {}}, Row(custom_id="c", kind=RowKind.CHAT, error="bad")),
    ({"custom_id": "c", "url": COMPLETIONS}, Row(custom_id="c", kind=RowKind.COMPLETION,
                                                 error="bad")),
    ({"custom_id": "c", "url": EMBEDDINGS}, Row(custom_id="c", kind=RowKind.EMBEDDINGS,
                                                error="bad")),
])
def test_a_refused_row_keeps_its_custom_id_and_kind(obj: Any, row: Row) -> None:
    assert rejected_row(obj, 3, "bad") == row


@pytest.mark.parametrize("obj", [
    [1], "x", {"url": CHAT, "body": {}}, {"custom_id": "", "body": {}},
    {"prompt": "x", "custom_id": True}, {"prompt": "x", "custom_id": [1]},
    {"prompt": "x", "custom_id": None},
])
def test_a_refused_row_without_a_custom_id_to_report_is_an_error(obj: Any) -> None:
    with pytest.raises(ValueError) as e:
        rejected_row(obj, 0, "the reason")
    assert str(e.value) == "the reason"


def test_refused_lines() -> None:
    assert rejected_line(Row(custom_id="a", kind=RowKind.PLAIN, error="bad")) == {
        "custom_id": "a", "job_id": None, "status": "failed", "text": None,
        "finish_reason": None, "usage": None, "error": "bad"}
    assert rejected_line(Row(custom_id="a", kind=RowKind.CHAT, error="bad")) == {
        "id": "batch_req_a", "custom_id": "a",
        "response": {"status_code": 400, "request_id": None, "body": {"error": {
            "message": "bad", "type": "invalid_request_error", "param": None, "code": None}}},
        "error": None}


# --- output lines ----------------------------------------------------------------------------

def _info(status: JobStatus, result: JobResult | None = None, error: str | None = None,
          stats: JobStats | None = None, finished_at: datetime | None = FINISHED) -> JobInfo:
    return JobInfo(id="j1", batch_id="b", custom_id="c1", model="m", status=status,
                   priority=0, metadata={}, created_at=FINISHED, started_at=FINISHED,
                   finished_at=finished_at, deadline=None, attempts=1, worker_id="w",
                   error=error, result=result, stats=stats)


USAGE = Usage(prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=3)
STEPS = [
    TokenLogprob(token="ab", token_id=1, logprob=-0.5, bytes=[97, 98], top_logprobs=[
        TopLogprob(token="ab", token_id=1, logprob=-0.5, bytes=[97, 98]),
        TopLogprob(token="c", token_id=2, logprob=-1.5, bytes=[99])]),
    TokenLogprob(token="d", token_id=3, logprob=-0.25, bytes=[100], top_logprobs=[]),
]


def test_a_plain_line_of_a_succeeded_job() -> None:
    result = JobResult(text="abd", token_ids=[1, 3], finish_reason=FinishReason.STOP, usage=USAGE)
    assert output_line(RowKind.PLAIN, _info(JobStatus.SUCCEEDED, result, error="ignored",
                                            stats=JobStats(e2e_s=2.5))) == {  # type: ignore[call-arg]
        "custom_id": "c1", "job_id": "j1", "status": "succeeded", "text": "abd",
        "finish_reason": "stop", "usage": {"prompt_tokens": 10, "cached_prompt_tokens": 4,
                                           "completion_tokens": 3},
        "error": None, "e2e_s": 2.5}


def test_a_plain_line_with_samples_and_logprobs() -> None:
    result = JobResult(text="abd", token_ids=[1, 3], finish_reason=FinishReason.STOP,
                       usage=USAGE, logprobs=STEPS, choices=[
                           Choice(index=0, text="abd", token_ids=[1, 3],
                                  finish_reason=FinishReason.STOP, logprobs=STEPS),
                           Choice(index=1, text="x", token_ids=[9],
                                  finish_reason=FinishReason.LENGTH)])
    line = output_line(RowKind.PLAIN, _info(JobStatus.SUCCEEDED, result))
    steps = [s.model_dump() for s in STEPS]
    assert line["choices"] == ["abd", "x"]
    assert line["logprobs"] == steps
    assert line["choices_logprobs"] == [steps, []]
    assert "e2e_s" not in line and "embeddings" not in line


def test_a_plain_line_with_logprobs_of_one_sample_and_embeddings() -> None:
    line = output_line(RowKind.PLAIN, _info(JobStatus.SUCCEEDED, JobResult(
        logprobs=STEPS[1:], embeddings=[[0.5]])))
    assert line["logprobs"] == [STEPS[1].model_dump()]
    assert line["embeddings"] == [[0.5]]
    assert "choices" not in line and "choices_logprobs" not in line


def test_a_plain_line_of_a_failed_job_without_result() -> None:
    assert output_line(RowKind.PLAIN, _info(JobStatus.FAILED, error="boom")) == {
        "custom_id": "c1", "job_id": "j1", "status": "failed", "text": None,
        "finish_reason": None, "usage": None, "error": "boom"}


def test_a_chat_line_of_a_succeeded_job() -> None:
    result = JobResult(text="abd", token_ids=[1, 3], finish_reason=FinishReason.ABORT, usage=USAGE,
                       logprobs=STEPS)
    assert output_line(RowKind.CHAT, _info(JobStatus.SUCCEEDED, result)) == {
        "id": "batch_req_j1", "custom_id": "c1", "error": None,
        "response": {"status_code": 200, "request_id": "j1", "body": {
            "id": "chatcmpl-j1", "object": "chat.completion",
            "created": int(FINISHED.timestamp()), "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "abd"},
                         "finish_reason": "stop", "logprobs": {"content": [
                             {"token": "ab", "logprob": -0.5, "bytes": [97, 98],
                              "top_logprobs": [
                                  {"token": "ab", "logprob": -0.5, "bytes": [97, 98]},
                                  {"token": "c", "logprob": -1.5, "bytes": [99]}]},
                             {"token": "d", "logprob": -0.25, "bytes": [100],
                              "top_logprobs": []}], "refusal": None}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                      "prompt_tokens_details": {"cached_tokens": 4}}}}}


def test_a_completions_line_with_samples() -> None:
    result = JobResult(text="abd", token_ids=[1, 3], finish_reason=FinishReason.STOP,
                       usage=USAGE, logprobs=STEPS, choices=[
                           Choice(index=0, text="abd", token_ids=[1, 3],
                                  finish_reason=FinishReason.ABORT, logprobs=STEPS),
                           Choice(index=1, text="x", token_ids=[9],
                                  finish_reason=FinishReason.LENGTH)])
    body = output_line(RowKind.COMPLETION, _info(JobStatus.SUCCEEDED, result,
                                                 finished_at=None))["response"]["body"]
    assert (body["id"], body["object"], body["created"]) == ("cmpl-j1", "text_completion", 0)
    assert body["choices"] == [
        {"index": 0, "text": "abd", "finish_reason": "stop", "logprobs": {
            "tokens": ["ab", "d"], "token_logprobs": [-0.5, -0.25],
            "top_logprobs": [{"ab": -0.5, "c": -1.5}, {}], "text_offset": [0, 2]}},
        {"index": 1, "text": "x", "finish_reason": "length", "logprobs": None}]


def test_an_embeddings_line() -> None:
    result = JobResult(usage=Usage(prompt_tokens=6), embeddings=[[0.5, 1.0], [2.0, 0.0]])
    assert output_line(RowKind.EMBEDDINGS, _info(JobStatus.SUCCEEDED, result)) == {
        "id": "batch_req_j1", "custom_id": "c1", "error": None,
        "response": {"status_code": 200, "request_id": "j1", "body": {
            "object": "list", "model": "m",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 1.0]},
                     {"object": "embedding", "index": 1, "embedding": [2.0, 0.0]}],
            "usage": {"prompt_tokens": 6, "total_tokens": 6}}}}


@pytest.mark.parametrize("result", [None, JobResult(usage=Usage(prompt_tokens=6))])
def test_a_succeeded_embeddings_job_without_vectors_is_a_bug_not_a_line(
        result: JobResult | None) -> None:
    with pytest.raises(AssertionError):
        output_line(RowKind.EMBEDDINGS, _info(JobStatus.SUCCEEDED, result))


@pytest.mark.parametrize(("error", "status_code", "kind", "message"), [
    ("prompt is empty", 400, "invalid_request_error", "prompt is empty"),
    (f"{ENGINE_FAULT}: boom", 500, "server_error", f"{ENGINE_FAULT}: boom"),
    (None, 400, "invalid_request_error", "failed"),
])
def test_a_failed_job_is_a_request_error(error: str | None, status_code: int, kind: str,
                                         message: str) -> None:
    assert output_line(RowKind.COMPLETION, _info(JobStatus.FAILED, error=error)) == {
        "id": "batch_req_j1", "custom_id": "c1", "error": None,
        "response": {"status_code": status_code, "request_id": "j1", "body": {"error": {
            "message": message, "type": kind, "param": None, "code": None}}}}


@pytest.mark.parametrize(("status", "error", "code", "message"), [
    (JobStatus.EXPIRED, "deadline passed", "batch_expired", "deadline passed"),
    (JobStatus.CANCELLED, None, "batch_cancelled", "cancelled"),
    (JobStatus.EXPIRED, None, "batch_expired", "expired"),
])
def test_an_ended_job_has_no_response(status: JobStatus, error: str | None, code: str,
                                      message: str) -> None:
    assert output_line(RowKind.EMBEDDINGS, _info(status, error=error)) == {
        "id": "batch_req_j1", "custom_id": "c1", "response": None,
        "error": {"code": code, "message": message}}


def test_completions_text_offsets_add_up_the_token_lengths() -> None:
    steps = [TokenLogprob(token=t, token_id=i, logprob=-1.0, bytes=list(t.encode()))
             for i, t in enumerate(["ab", "c", "def", ""])]
    result = JobResult(text="abcdef", token_ids=[0, 1, 2, 3], usage=USAGE, logprobs=steps)
    body = output_line(RowKind.COMPLETION, _info(JobStatus.SUCCEEDED, result))["response"]["body"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 2, 3, 6]
