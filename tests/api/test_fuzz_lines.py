"""A fuzzer of API batch lines, sized for CI: hypothesis builds lines (a healthy chat request with
one field replaced by any JSON value, nested lists and objects, unicode, huge numbers, odd JSON
schemas and regexes; or a line that is not JSON at all), each goes to a real ``kvbatch serve``
as its own batch, and a healthy batch goes beside them. Every batch must end with a reason (a
failed batch names its lines' errors, a completed one accounts for its row in its output or
error file), the server must stay up and healthy, and the healthy batch must complete.
``KVBATCH_SOAK=1`` tries 10x more lines; ``-s`` prints how the lines ended (docs/reliability.md
quotes a run)."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from typing import Any

import openai
import pytest
from api_server import ApiServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from services import SOAK
from test_openai_api import chat_row, jsonl, lines_of, upload, wait_batch

from jobs.schemas import JobSpec

EXAMPLES = 300 if SOAK else 30  # CI: ~20 s, the batches on the tiny model included
FIELDS = ("model", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
          "logprobs", "top_logprobs", "response_format", "metadata", "priority", "prompt")

scalars = (st.none() | st.booleans() | st.integers(-3, 40)
           | st.sampled_from([2**63, -2**63, 10**30])
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
patterns = st.text(alphabet="ab.*+?|()[]{}^$\\-,12é\x00", max_size=16)
schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "boolean", "null",
                                                    "nonsense"])},
                          optional={"pattern": patterns, "enum": st.lists(values, max_size=3),
                                    "minLength": st.integers(-1, 5)}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object"),
                                         "properties": st.dictionaries(st.text(max_size=6),
                                                                       inner, max_size=3)})
    | st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
    max_leaves=6)
response_formats = (st.builds(lambda s: {"type": "json_schema",
                                         "json_schema": {"name": "f", "schema": s}}, schemas)
                    | st.builds(lambda p: {"type": "regex", "regex": p}, patterns)
                    | st.builds(lambda t: {"type": t}, st.text(max_size=12)))


DEEP = "kvbatch-fuzz-deep"  # replaced in the line's text: json.dumps recurses


@st.composite
def lines(draw: st.DrawFn) -> str:
    """One batch line: a healthy chat request with one field changed, or no JSON at all."""
    # weighted towards lines that pass validation and reach the worker
    kind = draw(st.sampled_from(["body", "body", "messages", "messages", "response_format",
                                 "response_format", "response_format", "envelope", "deep",
                                 "text"]))
    row: dict[str, Any] = chat_row("fuzz", max_tokens=3)
    if kind == "text":
        return draw(st.text(max_size=200).filter(lambda t: "\n" not in t and "\r" not in t))
    if kind == "deep":
        row["body"][draw(st.sampled_from(FIELDS))] = DEEP
        depth = draw(st.integers(1, 3000))
        return json.dumps(row).replace(f'"{DEEP}"', "[" * depth + '"x"' + "]" * depth)
    elif kind == "messages":
        row["body"]["messages"] = draw(st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | st.text(max_size=5),
             "content": st.text(max_size=300) | values}), min_size=1, max_size=3))
    elif kind == "response_format":
        row["body"]["response_format"] = draw(response_formats)
    elif kind == "envelope":
        row[draw(st.sampled_from(["custom_id", "method", "url", "body"]))] = draw(values)
    else:
        field = draw(st.sampled_from(FIELDS))
        row["body"][field] = draw(response_formats if field == "response_format" else values)
    return json.dumps(row, ensure_ascii=draw(st.booleans()))


def _has_a_reason(client: openai.OpenAI, batch_id: str) -> str:
    """How the batch ended, once checked: ``failed: <first error's code>``, ``completed: ran``
    or ``completed: row failed``."""
    done = wait_batch(client, batch_id, timeout_s=180)
    assert done.status in {"completed", "failed"}, done
    if done.status == "failed":
        assert done.errors is not None and done.errors.data, done
        assert all(e.message for e in done.errors.data), done.errors
        return f"failed: {done.errors.data[0].code}"
    counts = done.request_counts
    assert counts is not None and counts.total == 1 == counts.completed + counts.failed, done
    file_id = done.output_file_id if counts.completed else done.error_file_id
    assert file_id is not None, done
    [line] = lines_of(client, file_id)
    # the row's own custom_id, as a string (a fuzzed envelope may replace "fuzz")
    assert isinstance(line["custom_id"], str) and line["custom_id"], line
    if counts.failed:
        assert line["response"]["body"]["error"]["message"], line
        return "completed: row failed"
    return "completed: ran"


def test_fuzzed_lines_all_end_with_a_reason_and_a_healthy_batch_completes(
        openai_client, server: ApiServer, start_worker) -> None:  # type: ignore[no-untyped-def]
    client = openai_client()
    start_worker()
    batch_ids: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(lines())
    # found by this fuzzer: an empty chat passed validation, then crashed routing on every try
    @example(json.dumps(chat_row("fuzz", messages=[])))
    def submit(line: str) -> None:
        file_id = upload(client, line.encode() + b"\n")  # a 4xx here raises: none is expected
        batch_ids.append(client.batches.create(input_file_id=file_id,
                                               endpoint="/v1/chat/completions",
                                               completion_window="24h").id)

    submit()
    healthy = client.batches.create(
        input_file_id=upload(client, jsonl([chat_row(f"ok-{i}") for i in range(3)])),
        endpoint="/v1/chat/completions", completion_window="24h")
    ended = Counter(_has_a_reason(client, batch_id) for batch_id in batch_ids)
    print(f"{len(batch_ids)} fuzzed lines ended:", dict(ended.most_common()))
    done = wait_batch(client, healthy.id)
    assert done.status == "completed" and done.output_file_id, done
    assert sorted(x["custom_id"] for x in lines_of(client, done.output_file_id)) == [
        "ok-0", "ok-1", "ok-2"]
    assert server.proc is not None and server.proc.poll() is None
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as health:
        assert health.status == 200


def test_the_empty_chat_the_fuzzer_found_is_refused_naming_messages() -> None:
    with pytest.raises(ValidationError, match=r"messages\n  List should have at least 1 item"):
        JobSpec(model="tiny", messages=[])
