"""``kvbatch demo``: generate answers for built-in prompts and show throughput and KV stats."""

from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

SYSTEM_PROMPT = (
    "You are kvbatch's demo assistant. Answer the user's question in one or two short "
    "sentences, in plain English, without lists or headings."
)
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me a tip for writing clean Python code.",
    "What does a GPU do?",
    "Name a famous painting and its painter.",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a friendly robot.",
)


def run_demo(model: str, dtype: str, max_tokens: int) -> int:
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype))
    load_s = time.perf_counter() - t0
    prompts = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=True)
    gen_s = time.perf_counter() - t0

    for question, out in zip(QUESTIONS, outputs, strict=True):
        print(f"\nQ: {question}\nA: {out.text.strip()}  [{out.finish_reason}]")
    stats = engine.stats()
    generated = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    info = engine.info
    print(
        f"\nmodel {model} ({dtype}) on {info.device}, attention {info.attention_backend}, "
        f"loaded in {load_s:.1f} s"
    )
    print(
        f"{len(outputs)} requests, {prompt_tokens} prompt tokens "
        f"({stats.prefix_cache_hits} from the prefix cache, "
        f"hit rate {stats.prefix_cache_hit_rate:.0%}), {generated} generated tokens in "
        f"{gen_s:.1f} s: {generated / gen_s:.1f} output tok/s, "
        f"{(stats.num_prompt_tokens + generated) / gen_s:.1f} processed tok/s"
    )
    peak = max(o.metrics.peak_kv_bytes for o in outputs)
    print(
        f"KV cache: {info.num_kv_blocks} blocks x {info.kv_bytes_per_block / 2**10:.0f} KiB "
        f"(block size {engine.config.block_size}), largest request held "
        f"{peak / 2**20:.1f} MiB, {stats.num_steps} steps, "
        f"{stats.tokens_per_step:.1f} tokens/step, {stats.num_preemptions} preemptions"
    )
    return 0
