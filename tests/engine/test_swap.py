"""Swap preemption on the CPU, where the host pool is a second tensor: a round trip through it
gives the outputs of recompute preemption and of a run with no preemption at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.outputs import RequestOutput

PROMPTS = [f"prompt number {i}: " + "abc " * (2 + 3 * (i % 4)) for i in range(8)]
# Seeded sampling, n = 2 for some (forks share blocks), logprobs: everything a preempted
# sequence carries across the round trip.
PARAMS = [
    SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, min_tokens=24,
                   logprobs=3, n=2 if i % 3 == 0 else 1)
    for i in range(len(PROMPTS))
]
TIGHT = dict(num_kv_blocks=14, block_size=8, max_num_batched_tokens=64)


def _generate(model: Path, **cfg: object) -> tuple[LLMEngine, list[RequestOutput]]:
    engine = LLMEngine(EngineConfig(model=str(model), **cfg))  # type: ignore[arg-type]
    return engine, engine.generate(PROMPTS, PARAMS)


def _tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def unpreempted(tiny_model: Path) -> tuple[LLMEngine, list[RequestOutput]]:
    return _generate(tiny_model, num_kv_blocks=256, block_size=8)


@pytest.mark.parametrize("swap_blocks", [0, 6, 1000])  # recompute, a mix, all swapped
def test_preemption_round_trips_give_the_unpreempted_outputs(
    tiny_model: Path, unpreempted: tuple[LLMEngine, list[RequestOutput]], swap_blocks: int
) -> None:
    roomy, expected = unpreempted
    per_block = roomy.info.kv_bytes_per_block
    engine, outputs = _generate(tiny_model, swap_space_bytes=swap_blocks * per_block, **TIGHT)
    stats = engine.stats()
    assert engine.info.num_swap_blocks == swap_blocks
    assert stats.num_preemptions > 0
    if swap_blocks == 0:
        assert stats.num_swaps == 0 and engine.kv.host_pool is None
    elif swap_blocks == 6:
        assert 0 < stats.num_swaps < stats.num_preemptions
    else:
        assert stats.num_swaps == stats.num_preemptions
    assert _tokens(outputs) == _tokens(expected)
    for out, ref in zip(outputs, expected, strict=True):
        for sample, ref_sample in zip(out.outputs, ref.outputs, strict=True):
            for ours, theirs in zip(sample.logprobs or [], ref_sample.logprobs or [],
                                    strict=True):
                assert ours.keys() == theirs.keys()
                torch.testing.assert_close(torch.tensor(list(ours.values())),
                                           torch.tensor(list(theirs.values())))
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total, "device blocks leaked"
    assert stats.num_swapped == 0
    if engine.kv.host_pool is not None:
        assert engine.kv.host_pool.num_free_blocks == swap_blocks, "host blocks leaked"


def test_swap_moves_the_kv_through_the_host_tensor(tiny_model: Path) -> None:
    # The host tensor really holds the KV: corrupting it while sequences are swapped out
    # changes what they generate afterwards.
    engine = LLMEngine(EngineConfig(model=str(tiny_model), swap_space_bytes=2**20, **TIGHT))
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    host = engine.runner.host_kv_caches
    assert host is not None and host.device.type == "cpu"
    corrupted = False
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if engine.scheduler.swapped and not corrupted:
            host.normal_(std=10.0)
            corrupted = True
    assert corrupted
    fresh = LLMEngine(EngineConfig(model=str(tiny_model), swap_space_bytes=2**20, **TIGHT))
    clean = fresh.generate(PROMPTS, PARAMS)
    assert _tokens([outputs[f"r{i}"] for i in range(len(PROMPTS))]) != _tokens(clean)
