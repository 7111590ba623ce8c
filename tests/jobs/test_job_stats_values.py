"""Per-job statistics are the values of what the engine did, not just present: two requests
that share a 24-token prefix on a KV pool too small for both to finish together. The later one
is preempted exactly once (recomputed after the first finishes), reads the shared prefix from
the cache (three full blocks of 8), and both peak at the blocks their last step needed; the
latencies are ordered as the request lived them. Checked on the engine's ``RequestMetrics``
and through a worker into the ``job_stats`` view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.outputs import RequestOutput
from jobs.client import JobClient
from jobs.constants import Keys
from jobs.schemas import JobSpec, JobStatus

BLOCK = 8
POOL_BLOCKS = 10  # 80 tokens: one request of 68 fits, two do not
PREFIX = "a shared prefix, 24 tok"  # 23 bytes: one token each, the 24th is the first of a tail
TAILS = ("!AAAA", "!BBBB")  # 5 more tokens each: prompts of 28
MAX_TOKENS = 40
PROMPT_TOKENS = len(PREFIX) + len(TAILS[0])
# The last step feeds the sequence's second-to-last token: its KV holds prompt + output - 1.
PEAK_BLOCKS = -(-(PROMPT_TOKENS + MAX_TOKENS - 1) // BLOCK)
CACHED = 24  # the prefix's three full blocks (the 24th token, '!', is shared too)


def _bytes_per_block(model: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # K and V, every layer, float32
    return 2 * config["num_hidden_layers"] * BLOCK * config["num_key_value_heads"] * head_dim * 4


def _run_apart(engine: LLMEngine, params: SamplingParams) -> dict[str, RequestOutput]:
    """A first, B one step later (A's prefix is computed by then)."""
    prompts = [PREFIX + tail for tail in TAILS]
    done: dict[str, RequestOutput] = {}
    engine.add_request("A", prompts[0], params)
    done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.add_request("B", prompts[1], params)
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def test_request_metrics_are_what_the_engine_did(tiny_model: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=POOL_BLOCKS,
                                    block_size=BLOCK, dtype="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _run_apart(engine, params)
    a, b = outs["A"].metrics, outs["B"].metrics
    stats = engine.stats()
    assert engine.info.kv_bytes_per_block == _bytes_per_block(tiny_model)
    for m in (a, b):
        assert (m.num_prompt_tokens, m.num_generated_tokens) == (PROMPT_TOKENS, MAX_TOKENS)
        assert m.peak_kv_blocks == PEAK_BLOCKS
        assert m.peak_kv_bytes == PEAK_BLOCKS * _bytes_per_block(tiny_model)
        assert m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.finish_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, CACHED)
    assert stats.prefix_cache_hits == CACHED
    # B, the later arrival, is the victim; it waits for A's blocks, so once.
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert stats.num_preemptions == 1 and stats.num_swaps == 0
    assert a.first_token_time <= b.arrival_time  # B arrived after A's first step
    assert a.finish_time is not None and b.finish_time is not None
    assert a.finish_time < b.finish_time


def test_job_stats_rows_carry_the_engines_values(
        redis_client: redis.Redis, keys: Keys, pg_engine: sa.Engine, tiny_model: str,
        start_worker) -> None:  # type: ignore[no-untyped-def]
    client = JobClient(redis_client, pg_engine, key_prefix=keys.prefix)
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    specs = [JobSpec(model="tiny", raw_prompt=PREFIX + tail, sampling=greedy, batch_id="stats",
                     custom_id=name) for name, tail in zip("AB", TAILS, strict=True)]
    client.submit(specs)
    running = start_worker(num_kv_blocks=POOL_BLOCKS, block_size=BLOCK, dtype="float32")
    infos = client.wait([s.id for s in specs], timeout_s=120)
    assert [i.status for i in infos] == [JobStatus.SUCCEEDED] * 2
    a, b = (i.stats for i in infos)
    assert a is not None and b is not None
    for s in (a, b):
        assert (s.prompt_tokens, s.generated_tokens) == (PROMPT_TOKENS, MAX_TOKENS)
        assert (s.peak_kv_blocks, s.peak_kv_bytes) == (
            PEAK_BLOCKS, PEAK_BLOCKS * _bytes_per_block(tiny_model))
        assert s.queue_wait_s is not None and s.ttft_s is not None and s.e2e_s is not None
        assert s.tpot_s is not None
        assert 0 <= s.queue_wait_s <= s.ttft_s <= s.e2e_s
        # tpot is the time from the first token to the last over the tokens between them
        assert s.e2e_s - s.ttft_s == pytest.approx(s.tpot_s * (MAX_TOKENS - 1), rel=1e-6)
    # Both run from the same step: A computes the prefix, B reads it; B is the victim.
    assert (a.cached_prompt_tokens, b.cached_prompt_tokens) == (0, CACHED)
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert a.e2e_s < b.e2e_s  # B finished after A, which it waited for
    engine_stats = running.worker.engine_stats
    assert engine_stats is not None and engine_stats.num_preemptions == 1
    rows = {r["custom_id"]: r for r in client.job_stats_rows(batch_id="stats")}
    for name, s in (("A", a), ("B", b)):
        row = rows[name]
        assert row["status"] == "succeeded"
        for field, value in s.model_dump().items():
            assert row[field] == pytest.approx(value), (name, field)
