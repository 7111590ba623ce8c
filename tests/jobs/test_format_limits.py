"""Response formats too big to compile cheaply are refused at submission, torch-free, each
with a message naming its limit: properties across a schema, a pattern's length, a regex's,
a grammar's size. Formats at the limit pass."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from engine.sampling_params import (
    MAX_GRAMMAR_BYTES,
    MAX_PATTERN_CHARS,
    MAX_SCHEMA_PROPERTIES,
)
from jobs.schemas import JobSpec

BOMB = "((a{31}){31}){31}"  # ~0.6 s and 7-8 MB to compile, per property


def submit(response_format: dict[str, Any]) -> JobSpec:
    return JobSpec(model="m", prompt="p", sampling={"response_format": response_format})


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def flat(n: int, pattern: str = BOMB) -> dict[str, Any]:
    """An object of ``n`` string properties, each held to ``pattern``."""
    return {"type": "object",
            "properties": {f"p{i}": {"type": "string", "pattern": pattern} for i in range(n)}}


def split(n: int, per_object: int) -> dict[str, Any]:
    """``n`` pattern properties spread over nested objects of ``per_object`` each."""
    schema: dict[str, Any] = flat(0)
    for start in range(0, n, per_object):
        inner = flat(min(per_object, n - start))
        inner["properties"]["next"] = schema
        schema = inner
    return schema


def test_a_1500_property_nested_repeat_schema_is_refused_at_submission() -> None:
    with pytest.raises(ValidationError, match=f"more than {MAX_SCHEMA_PROPERTIES} properties "
                                              r"\(MAX_SCHEMA_PROPERTIES\)"):
        submit(schema_format(flat(1500)))


@pytest.mark.parametrize("per_object", [40, 100, 999])  # 25, 10, 1 objects deep
def test_properties_count_across_nested_objects(per_object: int) -> None:
    # Each object of split() carries one "next" property beside its pattern properties.
    objects = -(-MAX_SCHEMA_PROPERTIES // (per_object + 1))
    at_limit = split(MAX_SCHEMA_PROPERTIES - objects, per_object)
    assert submit(schema_format(at_limit)).sampling.response_format is not None
    with pytest.raises(ValidationError, match="MAX_SCHEMA_PROPERTIES"):
        submit(schema_format(split(MAX_SCHEMA_PROPERTIES + 1, per_object)))


def test_exactly_the_property_limit_passes() -> None:
    fmt = submit(schema_format(flat(MAX_SCHEMA_PROPERTIES, "a"))).sampling.response_format
    assert fmt is not None and fmt.json_schema is not None
    assert len(fmt.json_schema.schema["properties"]) == MAX_SCHEMA_PROPERTIES
    with pytest.raises(ValidationError, match="MAX_SCHEMA_PROPERTIES"):
        submit(schema_format(flat(MAX_SCHEMA_PROPERTIES + 1, "a")))


@pytest.mark.parametrize("where", ["pattern", "patternProperties", "deep pattern"])
def test_a_long_schema_pattern_is_refused(where: str) -> None:
    def schema(pattern: str) -> dict[str, Any]:
        if where == "pattern":
            return {"type": "string", "pattern": pattern}
        if where == "patternProperties":
            return {"type": "object", "patternProperties": {pattern: {"type": "string"}}}
        return {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": pattern}]}}

    assert submit(schema_format(schema("a" * MAX_PATTERN_CHARS))).sampling is not None
    with pytest.raises(ValidationError, match=f"a pattern of json_schema.schema is over "
                                              f"{MAX_PATTERN_CHARS} characters"):
        submit(schema_format(schema("a" * (MAX_PATTERN_CHARS + 1))))


def test_a_property_named_pattern_is_a_schema_not_a_pattern() -> None:
    schema = {"type": "object", "properties": {"pattern": {"type": "string"}}}
    assert submit(schema_format(schema)).sampling.response_format is not None


def test_a_long_regex_is_refused() -> None:
    ok = submit({"type": "regex", "regex": "a" * MAX_PATTERN_CHARS}).sampling.response_format
    assert ok is not None and ok.regex == "a" * MAX_PATTERN_CHARS
    with pytest.raises(ValidationError, match=f"response_format.regex is over "
                                              f"{MAX_PATTERN_CHARS} characters"):
        submit({"type": "regex", "regex": "a" * (MAX_PATTERN_CHARS + 1)})


def test_a_big_grammar_is_refused_counting_utf8_bytes() -> None:
    def grammar(n_bytes: int, char: str = "a") -> str:
        head = 'root ::= "'
        body = char * ((n_bytes - len(head) - 1) // len(char.encode()))
        return head + body + '"'

    assert len(grammar(MAX_GRAMMAR_BYTES).encode()) == MAX_GRAMMAR_BYTES
    assert submit({"type": "grammar", "grammar": grammar(MAX_GRAMMAR_BYTES)}).sampling is not None
    # Under the limit in characters, over it in bytes: "é" is two.
    wide = grammar(MAX_GRAMMAR_BYTES + 2, "é")
    assert len(wide) < MAX_GRAMMAR_BYTES < len(wide.encode())
    with pytest.raises(ValidationError, match=f"response_format.grammar is over "
                                              f"{MAX_GRAMMAR_BYTES} bytes"):
        submit({"type": "grammar", "grammar": wide})
