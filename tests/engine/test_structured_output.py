"""Grammar-constrained decoding on a tiny random model: whatever the weights, every output
matches its response format; a compiled grammar is shared; preemption, forks (n > 1) and
seeds keep it; a format the grammar library refuses fails its request alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampling_params import ResponseFormat

PROMPTS = ["Pick one:", "The answer is", "Say something.", "x" * 40]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["kind", "legs", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=128))


def _params(fmt: dict, **kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 7, "max_tokens": 64,
                             "response_format": fmt, **kw})  # type: ignore[arg-type]


def test_choice_regex_and_schema_outputs_always_match(engine: LLMEngine) -> None:
    # A random model left alone writes bytes at random: none of these would match.
    free = engine.generate(PROMPTS, _params({"type": "text"}, max_tokens=24))
    assert not any(o.text in ("yes", "no", "maybe") for o in free)

    choices = ["yes", "no", "maybe"]
    for out in engine.generate(PROMPTS * 3, _params({"type": "choice", "choice": choices})):
        assert out.text in choices and out.finish_reason == "stop", out.text

    regex = r"[0-9]{3}-[a-z]{2,4}"
    for out in engine.generate(PROMPTS, _params({"type": "regex", "regex": regex})):
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out.text

    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for out in engine.generate(PROMPTS, _params(fmt)):
        jsonschema.validate(json.loads(out.text), SCHEMA)

    grammar = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    for out in engine.generate(PROMPTS, _params({"type": "grammar", "grammar": grammar},
                                                max_tokens=8, ignore_eos=True)):
        # ignore_eos: the sample still ends where the grammar does, or at max_tokens
        assert re.fullmatch(r"\(\d+\)|\(\d*", out.text), out.text


def test_many_requests_sharing_a_schema_compile_it_once(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=1024))
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    outs = engine.generate([f"row {i}" for i in range(256)], _params(fmt, max_tokens=48))
    assert engine.stats().num_grammar_compiles == 1
    valid = [o for o in outs if o.finish_reason == "stop"]
    assert len(valid) == 256
    for out in valid:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # An equal format built separately is the same grammar; another one compiles once more.
    engine.generate(["a"], _params(dict(fmt)))
    engine.generate(["b", "c"], _params({"type": "choice", "choice": ["p", "q"]}))
    assert engine.stats().num_grammar_compiles == 2


def test_forked_samples_each_follow_the_grammar(engine: LLMEngine) -> None:
    choices = ["alpha", "beta", "gamma", "delta"]
    out = engine.generate(["Greek letter:"], _params({"type": "choice", "choice": choices},
                                                     n=6))[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 6 and all(t in choices for t in texts)
    assert len(set(texts)) > 1  # the samples are independent draws


def test_constrained_output_survives_preemption(tiny_model: Path) -> None:
    # 12 blocks of 8 tokens for 6 sequences that want ~13 tokens each: preemption happens.
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=12, block_size=8,
                                    max_num_seqs=6))
    regex = r"[a-z]{30,40}"
    params = _params({"type": "regex", "regex": regex}, max_tokens=48)
    outs = engine.generate([f"prompt number {i} ..." for i in range(6)], params)
    assert engine.stats().num_preemptions > 0
    for out in outs:
        assert re.fullmatch(regex, out.text), out.text
    # Seeded: the same tokens as a run without preemption.
    roomy = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=128, block_size=8))
    again = roomy.generate([f"prompt number {i} ..." for i in range(6)], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_a_format_the_library_refuses_fails_alone(engine: LLMEngine) -> None:
    outs = engine.generate(
        ["a", "b"],
        [_params({"type": "regex", "regex": "[a-"}), _params({"type": "choice", "choice": ["z"]})])
    assert outs[0].finish_reason == "error"
    assert "Unclosed '['" in (outs[0].error or "") and "cc:" not in (outs[0].error or "")
    assert outs[1].text == "z"
    (out,) = engine.generate(["x"], _params({"type": "grammar", "grammar": 'start ::= "a"'}))
    assert out.finish_reason == "error" and "root" in (out.error or "")


def test_logit_bias_and_n_greedy(engine: LLMEngine) -> None:
    base = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = engine.generate(["Hello"], base)[0].token_ids
    banned = engine.generate(["Hello"], SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logit_bias={first[0]: -100}))[0]
    assert banned.token_ids[0] != first[0]
    forced = engine.generate(["Hello"], SamplingParams(
        temperature=0.9, seed=3, max_tokens=4, ignore_eos=True, logit_bias={65: 100}))[0]
    assert forced.token_ids == [65] * 4
    same = engine.generate(["Hello"], SamplingParams(temperature=0, n=3, max_tokens=4,
                                                     ignore_eos=True))[0]
    assert [c.token_ids for c in same.outputs] == [first] * 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("lb", "x", SamplingParams(logit_bias={10**6: 1.0}))


def test_response_format_is_checked_when_built() -> None:
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        ResponseFormat(type="json_schema", json_schema={"schema": {"type": "nope"}})
    with pytest.raises(ValueError, match="needs 'regex'"):
        SamplingParams(response_format={"type": "regex"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(response_format={"type": "regex", "regexp": "a"})  # type: ignore
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    fmt = ResponseFormat(type="choice", choice=["a", "b"])
    assert fmt.key == ResponseFormat(type="choice", choice=("a", "b")).key
    assert fmt.key != ResponseFormat(type="choice", choice=["b", "a"]).key


def test_token_bytes_are_the_tokens_bytes(engine: LLMEngine) -> None:
    ascii_ids = [i for i in range(engine.info.vocab_size)
                 if engine.tokenizer.decode([i]).isascii() and engine.tokenizer.decode([i])]
    assert len(ascii_ids) > 90
    for i in ascii_ids:
        assert engine.token_bytes(i) == engine.tokenizer.decode([i]).encode()
    assert engine.token_bytes(engine.info.vocab_size + 5) == b""
