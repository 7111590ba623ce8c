"""End to end on the real default model (SmolLM2-135M-Instruct): greedy output in float32 is
token-identical to transformers, for a batch of mixed-length chat prompts sharing a system
prompt, with prefix caching and chunked prefill active."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.loader import ensure_default_model

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a meticulous assistant for a data team. Answer in plain English, keep answers "
    "short, and say so when you are not sure. Never invent numbers."
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph, with detail about chlorophyll, the light "
    "reactions, the Calvin cycle and why plants are green rather than black.",
    "hi",
    "List three prime numbers and explain why each is prime.",
    "Translate 'good morning' into French, Spanish and German.",
]
MAX_TOKENS = 32


def test_greedy_matches_transformers_on_smollm2() -> None:
    model_dir = ensure_default_model()
    engine = LLMEngine(
        EngineConfig(dtype="float32", kv_cache_memory_bytes=256 * 2**20,
                     max_num_batched_tokens=96)  # forces chunked prefill of the batch
    )
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
               for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))

    hf = hf_model(model_dir)
    for out in outs:
        ids = out.prompt_token_ids
        prompt = torch.tensor([ids])
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                          max_new_tokens=MAX_TOKENS, do_sample=False)
        ref_tokens = ref[0, len(ids):].tolist()
        assert out.token_ids == ref_tokens, out.text
        assert out.text.strip()
    # The system prompt's full blocks were computed once and reused by the other five.
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert cached[0] == 0 and min(cached[1:]) >= 32
    stats = engine.stats()
    assert stats.prefix_cache_hits == sum(cached)
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
