"""Input a careless or hostile tenant sends fails alone, with a readable reason, before
anything recursive walks it: deep schemas at submission, mistyped batch rows when typed."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from engine.sampling_params import MAX_SCHEMA_DEPTH
from jobs.rows import parse_row
from jobs.schemas import JobSpec


def nested_format(levels: int) -> dict[str, Any]:
    """A json_schema response format of ``levels`` objects, each the property of the last."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


def test_a_schema_nested_past_the_limit_is_refused_at_submission() -> None:
    # Each schema level is two JSON levels (the object, its properties); the string is one.
    deepest = (MAX_SCHEMA_DEPTH - 1) // 2
    spec = JobSpec(model="m", prompt="p", sampling={"response_format": nested_format(deepest)})
    assert spec.sampling.response_format is not None
    for levels in (deepest + 1, 120, 400):  # 120 once passed here and crashed the worker
        with pytest.raises(ValidationError, match=f"nested more than {MAX_SCHEMA_DEPTH} levels"):
            JobSpec(model="m", prompt="p", sampling={"response_format": nested_format(levels)})


def test_deep_arrays_count_as_nesting_too() -> None:
    schema: Any = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"anyOf": [schema]}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    with pytest.raises(ValidationError, match="nested more than"):
        JobSpec(model="m", prompt="p", sampling={"response_format": fmt})


def _openai_row(body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": 5}, "'messages' must be a list, not int"),
    ({"messages": "hi"}, "'messages' must be a list, not str"),
    ({"messages": [5]}, "each message must be an object"),
    ({"metadata": [1]}, "'metadata' must be a JSON object, not list"),
    ({"metadata": "x"}, "'metadata' must be a JSON object, not str"),
])
def test_a_mistyped_openai_row_is_a_value_error_naming_the_field(body: dict[str, Any],
                                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_row(_openai_row(body), 0)


def test_a_well_typed_openai_row_keeps_its_metadata() -> None:
    row = parse_row(_openai_row({"metadata": {"team": "a"}}), 0)
    assert row.metadata == {"team": "a"} and row.messages == [{"role": "user", "content": "hi"}]
