"""Generating up to the context limit: prompt + output is exactly ``max_model_len``, the last
sample ends with ``length``, whether the limit is the configured one, the model's own or what
the KV pool holds, and whether the prompt ran in one step or in chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.testing import make_tiny_model

LOTS = 1000  # max_tokens far past the limit: the limit decides


@pytest.mark.parametrize("prompt_len, max_model_len, block_size, step_tokens", [
    (40, 48, 8, 2048),  # the limit on a block boundary
    (47, 48, 8, 2048),  # room for one token
    (1, 17, 16, 2048),  # one token into a new block
    (20, 45, 8, 2048),  # the limit inside a block
    (40, 48, 8, 16),  # a prompt prefilled in chunks of 16
])
def test_generation_stops_exactly_at_max_model_len(
        tiny_model: Path, prompt_len: int, max_model_len: int, block_size: int,
        step_tokens: int) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64,
                                    block_size=block_size, max_model_len=max_model_len,
                                    max_num_batched_tokens=step_tokens))
    assert engine.info.max_model_len == max_model_len
    prompt = [(7 * i) % 200 + 10 for i in range(prompt_len)]
    params = [SamplingParams(temperature=0.0, max_tokens=LOTS, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=LOTS, ignore_eos=True)]
    outs = engine.generate([prompt, prompt], params)
    for out in outs:
        assert len(out.prompt_token_ids) == prompt_len
        for sample in out.outputs:
            assert prompt_len + len(sample.token_ids) == max_model_len
            assert sample.finish_reason == "length"
        assert out.metrics.num_generated_tokens == (max_model_len - prompt_len) * len(out.outputs)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_max_tokens_that_reach_the_limit_exactly(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, max_model_len=32))
    prompt = list(range(10, 30))  # 20 tokens: room for 12
    for max_tokens, produced in ((11, 11), (12, 12), (13, 12)):
        (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True))
        assert len(out.token_ids) == produced and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("full", list(range(10, 42)), SamplingParams(max_tokens=1))


def test_the_models_context_length_is_the_default_limit(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "short-context", max_position_embeddings=37)
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64))
    assert engine.info.max_model_len == 37
    (out,) = engine.generate([list(range(10, 40))], SamplingParams(
        temperature=0.0, max_tokens=LOTS, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_a_small_kv_pool_lowers_the_limit_to_what_it_holds(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=5, block_size=8))
    assert engine.info.max_model_len == 40  # 5 blocks of 8 tokens
    (out,) = engine.generate([list(range(10, 35))], SamplingParams(
        temperature=0.0, max_tokens=LOTS, ignore_eos=True))
    assert len(out.token_ids) == 15 and out.finish_reason == "length"
    assert out.metrics.peak_kv_blocks == 5
