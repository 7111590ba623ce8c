"""A request's ``gpu_s`` is its share of the engine steps it ran in: each step's time split
equally among the requests in it. Timed by a clock that ticks one second a call (the engine
reads it before and after each step's forward), so a step lasts exactly one second and the
shares are exact: alone, a request pays every step it ran in; two requests in the same steps
pay half each; a request's samples are one request; the shares of every step add up to the
number of steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.outputs import RequestOutput

MAX_TOKENS = 6  # with ignore_eos: a prefill step (the first token), then 5 decode steps


class TickingClock:
    """One second later on each call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return float(self.calls)

    @property
    def steps(self) -> int:
        return self.calls // 2  # read before and after each step


@pytest.fixture
def engine(tiny_model: Path) -> tuple[LLMEngine, TickingClock]:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, block_size=16,
                                    dtype="float32"))
    engine.step_clock = clock = TickingClock()
    return engine, clock


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def test_a_request_alone_pays_every_step_it_ran_in(
        engine: tuple[LLMEngine, TickingClock]) -> None:
    llm, clock = engine
    llm.add_request("A", "hello there", _params())
    (a,) = _drain(llm).values()
    assert clock.steps == MAX_TOKENS and a.metrics.gpu_s == MAX_TOKENS
    llm.add_request("B", "its samples are one request", _params(n=3))
    (b,) = _drain(llm).values()
    assert len(b.outputs) == 3 and b.metrics.gpu_s == MAX_TOKENS == clock.steps - MAX_TOKENS


def test_requests_in_the_same_steps_split_them(engine: tuple[LLMEngine, TickingClock]) -> None:
    llm, clock = engine
    llm.add_request("A", "hello there", _params())
    llm.add_request("B", "another prompt", _params())
    done = _drain(llm)
    assert clock.steps == MAX_TOKENS
    assert done["A"].metrics.gpu_s == done["B"].metrics.gpu_s == MAX_TOKENS / 2


def test_a_request_that_joins_later_shares_only_the_steps_it_ran_in(
        engine: tuple[LLMEngine, TickingClock]) -> None:
    llm, clock = engine
    llm.add_request("A", "hello there", _params())
    done = {o.request_id: o for o in llm.step() if o.finished}  # A alone: one step
    llm.add_request("B", "another prompt", _params())
    done |= _drain(llm)  # A and B for 5 steps, then B alone for its last
    assert clock.steps == MAX_TOKENS + 1
    shared = (MAX_TOKENS - 1) / 2
    assert done["A"].metrics.gpu_s == 1 + shared
    assert done["B"].metrics.gpu_s == shared + 1
    assert done["A"].metrics.gpu_s + done["B"].metrics.gpu_s == clock.steps
