"""A response format compiles beside the step loop, in a process of its own, on a time and
memory budget: a hostile format fails its request alone, the others run meanwhile, and the
next format compiles in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

# A string pattern of nested repeats: xgrammar takes ~0.6 s and ~8 MB per property to compile
# it, even for the tiny models' byte vocabulary.
NESTED = "((a{31}){31}){31}"


def hostile(properties: int) -> dict:
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": NESTED} for i in range(properties)}}
    return {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}


def _params(fmt: dict | None = None, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          response_format=fmt)


def _engine(model: Path, **budget: float) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=128,
                                  max_num_seqs=8, **budget))  # type: ignore[arg-type]


def test_a_format_over_the_time_budget_fails_alone(tiny_model: Path) -> None:
    # hostile(24) would take ~15 s; the harmless formats compile well inside 1.5 s on a slow
    # machine
    engine = _engine(tiny_model, grammar_compile_timeout_s=1.5)
    outs = engine.generate(["a", "b", "c"], [
        _params(hostile(24)), _params({"type": "choice", "choice": ["yes", "no"]}), _params()])
    assert outs[0].finish_reason == "error"
    assert outs[0].error == "response_format (json_schema): compiling took longer than 1.5 s"
    assert outs[1].text in ("yes", "no") and outs[1].finish_reason == "stop"
    assert len(outs[2].token_ids) == 8 and outs[2].error is None
    # The killed process is replaced for the next format.
    (again,) = engine.generate(["d"], [_params({"type": "regex", "regex": "[0-9]{3}"})])
    assert again.error is None and len(again.text) == 3 and again.text.isdigit()
    assert engine.stats().num_grammar_compiles == 2  # the choice and the regex


def test_a_format_over_the_memory_budget_fails_alone(tiny_model: Path) -> None:
    engine = _engine(tiny_model, grammar_compile_memory_bytes=16 << 20)
    outs = engine.generate(["a", "b"], [_params(hostile(6)), _params({"type": "json_object"})])
    assert outs[0].finish_reason == "error"
    assert outs[0].error == "response_format (json_schema): compiling needed more than 16 MiB"
    assert outs[1].error is None and outs[1].text.startswith("{")


def test_the_engine_steps_while_a_format_compiles(tiny_model: Path) -> None:
    engine = _engine(tiny_model)
    engine.add_request("slow", "a", _params(hostile(3)))
    engine.add_request("free", "b", _params(max_tokens=24))
    finished: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                if out.request_id == "free":
                    # 24 tokens ran while the grammar compiled: the constrained request
                    # has not been scheduled yet.
                    (slow,) = engine.scheduler.requests["slow"].seqs
                    assert slow.pending_grammar is not None and slow.num_computed_tokens == 0
    assert finished == ["free", "slow"]


def test_an_aborted_request_leaves_its_compile_behind(tiny_model: Path) -> None:
    engine = _engine(tiny_model)
    engine.add_request("slow", "a", _params(hostile(2)))
    engine.abort_request("slow")
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason) == ("slow", "abort")
    engine.add_request("next", "b", _params({"type": "choice", "choice": ["x"]}))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.text) for o in outs] == [("next", "x")]


@pytest.mark.parametrize(("field", "value"), [("grammar_compile_timeout_s", 0.0),
                                              ("grammar_compile_memory_bytes", 0)])
def test_the_budget_must_be_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]
