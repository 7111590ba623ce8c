"""The batch-invariant mode end to end: a prompt's greedy tokens and their log-probabilities are
the same alone and inside a batch of 64 (prefix-cached system prompt, chunked prefill, decode
steps of every size), in bf16; in float32 the mode's tokens are the default mode's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.loader import ensure_default_model
from engine.testing import make_random_adapter

SYSTEM = "You are a careful assistant for a data team. Answer briefly. " * 3
SAMPLING = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)


def _prompts(count: int, max_chars: int) -> list[list[dict[str, str]]]:
    rng = random.Random(7)
    letters = "abcdefghij klmnopqrstuvwxyz,."
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "".join(rng.choice(letters)
                                                 for _ in range(rng.randint(3, max_chars)))}]
            for _ in range(count)]


def _alone_and_batched(engine: LLMEngine, prompts: list, checked: int,
                       sampling: SamplingParams = SAMPLING) -> tuple[list, list]:
    alone = [engine.generate([p], sampling)[0] for p in prompts[:checked]]
    batched = engine.generate(prompts, sampling)[:checked]
    return alone, batched


def test_bf16_tokens_do_not_depend_on_the_batch(tiny_model: Path) -> None:
    # A step budget of 200 tokens cuts the batch's prompts at other places than alone.
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="bfloat16",
                                    batch_invariant=True, max_num_batched_tokens=200))
    alone, batched = _alone_and_batched(engine, _prompts(64, 100), checked=8)
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit for bit, not close
    assert engine.stats().prefix_cache_hits > 0  # the system prompt's blocks were shared


def test_bf16_adapted_tokens_do_not_depend_on_the_batch(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    # Rows of two adapters and of the base model: an adapted prompt alone and among 48 (of
    # every adapter, their products in steps of many rows).
    adapters = {name: make_random_adapter(Path(tiny_model), tmp_path / name, rank, seed=rank)
                for name, rank in (("a8", 8), ("a16", 16))}
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model), dtype="bfloat16", batch_invariant=True,
        max_num_batched_tokens=200, lora=tuple(f"{n}={p}" for n, p in adapters.items())))
    prompts, names = _prompts(48, 100), [None, "a8", "a16"]
    lora = [names[i % 3] for i in range(48)]
    alone = [engine.generate([p], SAMPLING, lora=n)[0] for p, n in zip(prompts[1:5], lora[1:5],
                                                                        strict=True)]
    batched = engine.generate(prompts, SAMPLING, lora=lora)[1:5]
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_float32_tokens_are_the_default_modes(tiny_model: Path) -> None:
    prompts = _prompts(16, 100)
    outs = {}
    for invariant in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32",
                                        batch_invariant=invariant, max_num_batched_tokens=200))
        outs[invariant] = engine.generate(prompts, SAMPLING)
    for default, invariant in zip(outs[False], outs[True], strict=True):
        assert default.token_ids == invariant.token_ids
        for d, i in zip(default.outputs[0].logprobs or [], invariant.outputs[0].logprobs or [],
                        strict=True):
            assert d.keys() == i.keys()
            assert all(abs(d[t] - i[t]) < 1e-4 for t in d)


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), dtype="bfloat16",
                                    batch_invariant=True, max_num_batched_tokens=200))
    sampling = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, ignore_eos=True,
                              seed=11)
    alone, batched = _alone_and_batched(engine, _prompts(32, 100), checked=4, sampling=sampling)
    assert [a.token_ids for a in alone] == [b.token_ids for b in batched]


@pytest.mark.parametrize(("config", "message"), [
    (dict(attention_backend="torch"), "cpu and triton attention backends"),
    (dict(dtype="float16"), "float32 or bfloat16"),
])
def test_refused_where_it_has_no_invariant_ops(tiny_model: Path, config: dict,
                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(tiny_model), batch_invariant=True, **config))


@pytest.mark.slow
def test_bf16_smollm2_alone_and_in_a_batch_of_64() -> None:
    engine = LLMEngine(EngineConfig(model=str(ensure_default_model()), dtype="bfloat16",
                                    batch_invariant=True, kv_cache_memory_bytes=512 * 2**20))
    alone, batched = _alone_and_batched(engine, _prompts(64, 300), checked=8)
    assert [a.token_ids for a in alone] == [b.token_ids for b in batched]


def test_bench_prints_the_modes_side_by_side(tiny_model: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from bench.batch_invariant import main

    assert main(["--model", str(tiny_model), "--num-requests", "8", "--checked", "4",
                 "--max-tokens", "4", "--repeats", "1", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[3:-1]}  # after the header
    assert rows["batch-invariant"][1:4] == ["4", "of", "4"]
    assert all(float(v) > 0 for v in rows["batch-invariant"][4:] + rows["default"][4:])
    assert lines[-1].startswith("batch-invariant / default: batch ")
