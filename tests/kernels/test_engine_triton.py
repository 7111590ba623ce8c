"""The engine end to end with the Triton attention backend: the same greedy tokens as torch."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.testing import make_tiny_model
from kernels import BACKEND_ENV, paged_decode

SHARED = list(range(20, 90))  # 70 tokens: four full blocks shared as a cached prefix
PROMPTS = [
    [7],
    list(range(3, 20)),  # 17 tokens: one block and one token
    [*SHARED, 1, 2, 3],
    [*SHARED, 4, 5],  # a prefix-cache hit on SHARED's full blocks: decodes run in cascade
    [*SHARED, 6],
    list(range(100, 180)),  # longer than the step budget: prefilled in chunks beside decodes
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gqa_model(tmp_path_factory):
    # GQA 3:1 with head_dim 10: the kernels pad it to 16 and mask.
    path = tmp_path_factory.mktemp("tiny-gqa3")
    return make_tiny_model(path, hidden_size=60, num_heads=6, num_kv_heads=2, head_dim=10)


def generate(model, backend):
    config = EngineConfig(
        model=str(model),
        attention_backend=backend,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
    )
    engine = LLMEngine(config)
    assert engine.info.attention_backend == backend
    tokens = [out.token_ids for out in engine.generate(PROMPTS, GREEDY)]
    assert engine.stats().prefix_cache_hits > 0
    return tokens


class _CountedLaunches:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_triton_backend_generates_the_torch_tokens(tiny_gqa_model, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    prefix_kernel = _CountedLaunches(paged_decode._shared_prefix_kernel)
    monkeypatch.setattr(paged_decode, "_shared_prefix_kernel", prefix_kernel)
    triton_tokens = generate(tiny_gqa_model, "triton")
    assert prefix_kernel.launches > 0  # decodes over SHARED ran in cascade
    assert triton_tokens == generate(tiny_gqa_model, "torch")
    assert all(len(tokens) == GREEDY.max_tokens for tokens in triton_tokens)
