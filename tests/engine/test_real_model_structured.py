"""Structured output on the real default model (SmolLM2-135M-Instruct, bf16 on the CPU):
48 sampled jobs (temperature 0.8, seeded) held to a JSON schema with a nested object, an
enum, an array and required fields all parse and validate with ``jsonschema``; the same
prompts without the constraint mostly do not. Regex and choice outputs all match."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "species": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "city": {"type": "string", "maxLength": 24}},
            "required": ["name", "city"],
            "additionalProperties": False,
        },
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 16},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "species", "age", "owner", "toys"],
    "additionalProperties": False,
}
ANIMALS = ["cat", "dog", "parrot", "goldfish", "hamster", "turtle"]
CITIES = ["Paris", "Lima", "Oslo", "Kyoto", "Cairo", "Austin", "Perth", "Quito"]
PROMPTS = [
    [{"role": "user", "content": f"Describe a pet {a} that lives in {c} as a JSON object with "
      "its name, species, age, owner (name and city) and a list of toys."}]
    for a in ANIMALS for c in CITIES
]  # 48


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig())  # the default model and dtype


def test_json_schema_outputs_all_validate(engine: LLMEngine) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    held = [SamplingParams(temperature=0.8, seed=i, max_tokens=160, response_format=fmt)
            for i in range(len(PROMPTS))]  # type: ignore[arg-type]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=160) for i in range(len(PROMPTS))]
    compiles = engine.stats().num_grammar_compiles  # the module's engine: other tests' formats
    constrained = engine.generate(PROMPTS, held)
    unconstrained = engine.generate(PROMPTS, free)
    assert engine.stats().num_grammar_compiles == compiles + 1  # 48 requests, one compile
    valid = sum(_valid(o.text) for o in constrained)
    free_valid = sum(_valid(o.text) for o in unconstrained)
    print(f"\nJSON schema: {valid}/48 valid with the constraint, {free_valid}/48 without")
    assert [o.finish_reason for o in constrained] == ["stop"] * 48
    assert valid == 48
    assert free_valid < 24  # the schema is not what the model writes on its own


def test_regex_and_choice_outputs_all_match(engine: LLMEngine) -> None:
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    questions = [[{"role": "user", "content": f"Give a date in {y} in ISO format."}]
                 for y in range(1990, 2006)]
    outs = engine.generate(questions, SamplingParams(
        temperature=0.8, seed=1, max_tokens=20,
        response_format={"type": "regex", "regex": date}))  # type: ignore[arg-type]
    assert all(re.fullmatch(date, o.text) for o in outs), [o.text for o in outs]

    labels = ["positive", "negative", "neutral"]
    reviews = ["I loved it!", "Terrible, never again.", "It was fine I guess.",
               "Best purchase of the year.", "Broke after one day.", "Arrived on Tuesday."]
    outs = engine.generate(
        [[{"role": "user", "content": f"Sentiment of this review: {r}"}] for r in reviews],
        SamplingParams(temperature=0.0, max_tokens=8,
                       response_format={"type": "choice", "choice": labels}))  # type: ignore
    assert all(o.text in labels for o in outs)
