"""The engine against transformers on the same weights: logits per step and greedy tokens.

Every configuration the engine can run in (prefix caching on/off, chunked prefill at a tiny
budget, a KV pool small enough to force preemptions, by recompute or swap) must give the same
results.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy

from engine import EngineConfig, LLMEngine, SamplingParams

NUM_NEW = 10
# Prompt lengths around the block size (16): 1, 15, 16, 17, and longer ones over several blocks.
PROMPT_LENS = (1, 15, 16, 17, 40, 70)

ENGINE_VARIANTS = {
    "default": dict(num_kv_blocks=128, max_num_batched_tokens=512),
    "no-prefix-cache": dict(num_kv_blocks=128, enable_prefix_caching=False),
    "chunked-budget-7": dict(num_kv_blocks=128, max_num_batched_tokens=7),
    "no-chunked-prefill": dict(
        num_kv_blocks=128, enable_chunked_prefill=False, max_num_batched_tokens=256
    ),
    # 10 blocks of 16 tokens for 6 sequences of up to 80 tokens: preemption is unavoidable.
    "preempting": dict(num_kv_blocks=10, block_size=16, max_num_batched_tokens=64),
    # The same, with a host pool for every preempted sequence's KV.
    "swapping": dict(num_kv_blocks=10, block_size=16, max_num_batched_tokens=64,
                     swap_space_bytes=2**20),
    "block-size-16": dict(num_kv_blocks=256, block_size=16, max_num_batched_tokens=33),
    # The CPU default is the cpu backend; the eager reference must agree too.
    "reference-attention": dict(num_kv_blocks=128, attention_backend="torch"),
}


def _prompts(vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


def _run(model_dir: Path, prompts: list[list[int]], **cfg: object) -> tuple[LLMEngine, list]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), **cfg))  # type: ignore[arg-type]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=20
    )
    return engine, engine.generate(prompts, params)


def _check_against_hf(model_dir: Path, prompts: list[list[int]], outputs: list) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(model_dir, prompt, NUM_NEW)
        assert out.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        for step, lp in enumerate(out.outputs[0].logprobs):
            ids = torch.tensor(list(lp))
            ours = torch.tensor(list(lp.values()))
            torch.testing.assert_close(ours, ref_logprobs[step, ids], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("model_name", ["llama-gqa3-hd10", "llama-mha", "llama-gqa8-tied",
                                        "qwen2-bias", "llama3-rope-sharded", "qwen3-sharded",
                                        "mistral-sharded"])
def test_tiny_models_match_transformers(tiny_models: dict[str, Path], model_name: str) -> None:
    model_dir = tiny_models[model_name]
    _, outputs = _run(model_dir, _prompts(200), **ENGINE_VARIANTS["default"])
    _check_against_hf(model_dir, _prompts(200), outputs)
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_engine_variants_match_transformers(tiny_model: Path, variant: str) -> None:
    prompts = _prompts(200, shared_prefix=80)  # 5 shared blocks: cascade decode runs
    engine, outputs = _run(tiny_model, prompts, **ENGINE_VARIANTS[variant])
    _check_against_hf(tiny_model, prompts, outputs)
    assert engine.info.attention_backend == ENGINE_VARIANTS[variant].get(
        "attention_backend", "cpu"
    )
    stats = engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total, "blocks leaked"
    if variant in ("preempting", "swapping"):
        assert stats.num_preemptions > 0
        assert sum(o.metrics.num_preemptions for o in outputs) == stats.num_preemptions
        assert stats.num_swaps == (stats.num_preemptions if variant == "swapping" else 0)
        assert stats.num_swapped == 0
        if variant == "swapping":
            assert engine.kv.host_pool.num_free_blocks == engine.info.num_swap_blocks
    if variant == "chunked-budget-7":
        assert stats.num_batched_tokens <= 7 * stats.num_steps
    if variant == "no-chunked-prefill":
        assert engine.info.max_model_len == 256  # a prompt must fit in one step
    if variant == "no-prefix-cache":
        assert stats.prefix_cache_hits == 0
