"""Graph-replayed decode steps: the batch-size ladder, padded decodes on static buffers (the
CPU runs them eagerly, which is what a graph replays) and, on CUDA, the captured graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import captures_decode_graphs, graph_batch_sizes
from engine.outputs import RequestOutput

# Five requests that finish one after another: decode batches of 5, 4, 3, 2, 1, padded to
# 8, 4, 4, 2, 1; the later, smaller steps run on rows an earlier, larger step left behind.
PROMPTS = [f"request {i}: " + "xyz " * (1 + 2 * i) for i in range(5)]
PARAMS = [
    SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6 + 3 * i,
                   min_tokens=6 + 3 * i, logprobs=2)
    for i in range(5)
]
SHARED = "a shared system prompt, long enough to be read in cascade " * 3


@pytest.mark.parametrize(("max_num_seqs", "expected"), [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
])
def test_ladder(max_num_seqs: int, expected: list[int]) -> None:
    assert graph_batch_sizes(max_num_seqs) == expected


@pytest.mark.parametrize(("device", "enforce_eager", "backend", "captured"), [
    ("cuda", False, "triton", True),
    ("cuda", True, "triton", False),
    # found on an H200: the reference backend's host reads broke the capture, and its steps
    ("cuda", False, "torch", False),
    ("cpu", False, "triton", False),  # the interpreter
    ("cpu", False, "cpu", False),
])
def test_only_the_triton_kernels_steps_are_captured(device: str, enforce_eager: bool,
                                                     backend: str, captured: bool) -> None:
    assert captures_decode_graphs(torch.device(device), enforce_eager, backend) is captured
    ladder = graph_batch_sizes(256)
    assert len(ladder) == 35 and ladder[-1] == 256


def _generate(engine: LLMEngine, prompts: list[str]) -> list[RequestOutput]:
    return engine.generate(prompts, PARAMS[: len(prompts)])


def _same(outputs: list[RequestOutput], expected: list[RequestOutput]) -> None:
    for out, ref in zip(outputs, expected, strict=True):
        assert out.token_ids == ref.token_ids
        for ours, theirs in zip(out.outputs[0].logprobs or [], ref.outputs[0].logprobs or [],
                                strict=True):
            assert ours.keys() == theirs.keys()
            torch.testing.assert_close(torch.tensor(list(ours.values())),
                                       torch.tensor(list(theirs.values())))


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prefix"])
def test_padded_decodes_give_the_eager_outputs(tiny_model: Path, shared: bool) -> None:
    prompts = [SHARED + p for p in PROMPTS] if shared else PROMPTS
    config = EngineConfig(model=str(tiny_model), num_kv_blocks=64, max_num_seqs=8)
    expected = _generate(LLMEngine(config), prompts)
    engine = LLMEngine(config)
    assert engine.runner.kv_caches.shape[2] == engine.kv.pool.num_blocks + 1  # padding block
    engine.runner.enable_decode_graphs(8, engine.info.max_model_len // engine.info.block_size,
                                       capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None
    outputs = _generate(engine, prompts)
    _same(outputs, expected)
    steps = engine.stats().num_steps
    if shared:  # decodes over the shared prefix read it in cascade, outside the graphs
        assert 0 < graphs.num_runs < steps
    else:  # every step after the prefill is a padded decode
        assert graphs.num_runs >= max(p.max_tokens for p in PARAMS) - 1
    stats = engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device (make gpu-check)")
def test_cuda_graphs_replay_the_eager_outputs(tiny_model: Path) -> None:
    config = dict(model=str(tiny_model), device="cuda", num_kv_blocks=256, max_num_seqs=16)
    eager = LLMEngine(EngineConfig(enforce_eager=True, **config))
    assert eager.runner.graphs is None
    expected = _generate(eager, PROMPTS)
    engine = LLMEngine(EngineConfig(**config))
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.graphs  # captured when first needed
    outputs = _generate(engine, PROMPTS)
    assert graphs.num_runs > 0 and sorted(graphs.graphs) == [1, 2, 4, 8]  # batches 5 .. 1
    _same(outputs, expected)
