"""A request that makes a step fail fails alone: bounds are checked when it is added, and a step
that raises anyway is bisected down to the request it raises for."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, PoolingParams, RequestOutput, SamplingParams

HEALTHY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = "a healthy co-tenant"


def finish_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until every request finished; their final outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=256))


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> list[int]:
    """The healthy request's output when it runs by itself."""
    return engine.generate([PROMPT], HEALTHY)[0].token_ids


def test_values_the_model_cannot_take_are_refused_when_added(engine: LLMEngine) -> None:
    vocab = engine.info.vocab_size
    for params, field in (
        (SamplingParams(stop_token_ids=[vocab], min_tokens=1, max_tokens=4), "stop_token_ids"),
        (SamplingParams(top_k=vocab + 1), "top_k"),
    ):
        with pytest.raises(ValueError, match=field):
            engine.add_request("poison", "x", params)
        assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="top_k"):  # 2**63 overflowed inside the sampler
        SamplingParams(top_k=2**63)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_a_request_that_breaks_the_step_fails_alone(engine: LLMEngine, alone: list[int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever raises inside the step for one request's rows: that request ends with the
    error, the others go on with the outputs they have alone, and no block leaks."""
    run = engine.runner.run

    def run_failing_for_poison(batch):  # type: ignore[no-untyped-def]
        if any(s.seq.request_id == "poison" for s in batch.seqs):
            raise IndexError("index 49152 is out of bounds for dimension 1 with size 49152")
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", run_failing_for_poison)
    free = engine.kv.pool.num_free_blocks
    for i in range(3):
        engine.add_request(f"ok-{i}", PROMPT, HEALTHY)
    engine.add_request("poison", "poison prompt", HEALTHY)
    done = finish_all(engine)
    assert done["poison"].finish_reason == "error"
    assert "IndexError: index 49152 is out of bounds" in (done["poison"].error or "")
    assert all(done[f"ok-{i}"].token_ids == alone and done[f"ok-{i}"].error is None
               for i in range(3))
    assert engine.kv.pool.num_free_blocks == free


def test_a_fault_costs_its_co_tenants_no_step(engine: LLMEngine, alone: list[int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What the failed step computed for the requests beside the faulty one is kept: a
    generation and an embedding finish in as many steps as without the fault, with the same
    outputs."""
    def run_to_end() -> tuple[int, dict[str, RequestOutput]]:
        steps, done = 0, {}
        while engine.has_unfinished_requests():
            steps += 1
            done |= {out.request_id: out for out in engine.step() if out.finished}
        return steps, done

    def add_co_tenants() -> None:
        engine.add_request("gen", PROMPT, HEALTHY)
        engine.add_request("emb", "an embedding co-tenant", PoolingParams())

    add_co_tenants()
    clean_steps, clean = run_to_end()
    run = engine.runner.run

    def run_failing_for_poison(batch):  # type: ignore[no-untyped-def]
        if any(s.seq.request_id == "poison" for s in batch.seqs):
            raise IndexError("index out of range in self")
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", run_failing_for_poison)
    add_co_tenants()
    engine.add_request("poison", "poison prompt", HEALTHY)
    steps, done = run_to_end()
    assert steps == clean_steps
    assert done["poison"].finish_reason == "error"
    assert done["gen"].token_ids == alone == clean["gen"].token_ids
    embedding, clean_embedding = done["emb"].outputs[0].embedding, clean["emb"].outputs[0].embedding
    assert embedding is not None and clean_embedding is not None
    assert torch.allclose(torch.tensor(embedding), torch.tensor(clean_embedding), atol=1e-5)


def test_an_engine_wide_fault_is_raised_not_blamed_on_requests(
        engine: LLMEngine, alone: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """When nothing of a failed step can run, a forward with no request in it decides: if it
    fails too, the fault is the engine's and is raised (a worker then hands its jobs to others
    instead of failing them); if it runs, the requests were the culprits, however many."""
    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "run", broken)
    monkeypatch.setattr(engine.runner, "warm_up", broken)  # the device itself is gone
    engine.add_request("only", PROMPT, HEALTHY)  # one request alone: no neighbour to compare
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()
    engine.abort_request("only")
    monkeypatch.undo()
    finish_all(engine)

    run = engine.runner.run

    def poisons(batch):  # type: ignore[no-untyped-def]
        if any(s.seq.request_id.startswith("poison") for s in batch.seqs):
            raise IndexError("index out of range in self")
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", poisons)
    for i in range(4):  # a bad dataset on an idle engine: each fails alone, no crash
        engine.add_request(f"poison-{i}", f"poison {i}", HEALTHY)
    done = finish_all(engine)
    assert sorted(done) == [f"poison-{i}" for i in range(4)]
    assert all(o.finish_reason == "error" and "IndexError" in (o.error or "")
               for o in done.values())
    engine.add_request("healthy", PROMPT, HEALTHY)
    assert finish_all(engine)["healthy"].token_ids == alone


def test_a_request_whose_text_cannot_be_decoded_fails_alone(
        engine: LLMEngine, alone: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop checks and detokenization run per request after the forward: a fault there ends
    that request, not the step."""
    stop_reason = engine.processor.stop_reason

    def failing_stop_reason(seq):  # type: ignore[no-untyped-def]
        if seq.request_id == "bad-text":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return stop_reason(seq)

    output = engine.processor.output

    def failing_output(request_id, *args, **kwargs):  # type: ignore[no-untyped-def]
        if request_id == "bad-text":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return output(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.processor, "stop_reason", failing_stop_reason)
    monkeypatch.setattr(engine.processor, "output", failing_output)  # decoding fails too
    engine.add_request("fine", PROMPT, HEALTHY)
    engine.add_request("bad-text", "another prompt", HEALTHY)
    done = finish_all(engine)
    assert done["bad-text"].finish_reason == "error"
    assert "UnicodeDecodeError" in (done["bad-text"].error or "")
    assert done["fine"].token_ids == alone
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


sampling = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 4),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([0.01, 0.5, 1.0]),
    "top_k": st.one_of(st.integers(0, 300), st.integers(2**31 - 8, 2**31 - 1)),
    "min_p": st.sampled_from([0.0, 0.3, 1.0]),
    "seed": st.one_of(st.none(), st.integers(0, 2**62)),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 1.5]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=sampling, prompt=st.one_of(st.text(max_size=20),
                                         st.lists(st.integers(-5, 2**20), max_size=6)))
def test_random_requests_never_hurt_a_healthy_neighbour(
        engine: LLMEngine, alone: list[int], params: dict, prompt: str | list[int]) -> None:
    """Any combination the job schema accepts: it is refused when added, fails alone, or
    runs; the healthy request next to it finishes with the output it has alone."""
    try:
        p = SamplingParams(**params)
    except ValueError:
        return  # refused at submission, with the field named
    engine.add_request("healthy", PROMPT, HEALTHY)
    with contextlib.suppress(ValueError):
        engine.add_request("random", prompt, p)
    outs = finish_all(engine)  # step() never raises for one request's sake
    assert outs["healthy"].token_ids == alone
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
