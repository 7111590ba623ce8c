"""Scheduler bookkeeping of prompt-only (pooling) sequences, without a model: they chunk like
prefills, never sample, finish at the step that computes their last prompt token with their
blocks freed (full ones kept in the prefix cache), share steps with generations, and start
their pooled sum again when preempted to recompute.

The model's place is taken by a partial of ones per chunk row, summed by the scheduler.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_scheduler import BS, NEXT_TOKEN, _order, add, make_scheduler

from engine.outputs import FinishReason, RequestMetrics
from engine.pooling_params import PoolingParams
from engine.sampler import Sampled
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelOutput, Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence

HIDDEN = 4


def add_pooling(sched: Scheduler, prompt: list[int], reads_cached_prefix: bool = True,
                dimensions: int | None = None) -> Sequence:
    metrics = RequestMetrics(arrival_time=time.monotonic())
    seq = Sequence(request_id=f"r{len(sched.requests)}", prompt_token_ids=prompt,
                   params=SamplingParams(), metrics=metrics, arrival_order=next(_order),
                   pooling=PoolingParams(dimensions), reads_cached_prefix=reads_cached_prefix)
    sched.add_request(Request(seq.request_id, prompt, seq.params, metrics, [seq]))
    return seq


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    """One step: sampling sequences get NEXT_TOKEN, pooling ones a partial of ones per
    computed row (so a finished one pooled ``[rows computed] * HIDDEN`` before normalizing)."""
    out = sched.schedule()
    result = ModelOutput(
        sampled={s.seq.seq_id: [Sampled(NEXT_TOKEN, None)] for s in out.seqs if s.sample},
        pooled={s.seq.seq_id: torch.full((HIDDEN,), float(s.num_new_tokens))
                for s in out.seqs if s.seq.pooling is not None})
    update = sched.update(out, result)
    return out, [s for s in update.progressed if s.is_finished]


@pytest.mark.parametrize(("prompt_len", "budget", "chunks"), [
    (1, 16, [(0, 1)]),
    (15, 16, [(0, 15)]),
    (16, 16, [(0, 16)]),
    (17, 16, [(0, 16), (16, 1)]),
    (40, 16, [(0, 16), (16, 16), (32, 8)]),
    (33, 11, [(0, 11), (11, 11), (22, 11)]),
])
def test_a_pooling_prompt_chunks_never_samples_and_finishes_at_its_last_token(
        prompt_len: int, budget: int, chunks: list[tuple[int, int]]) -> None:
    sched = make_scheduler(budget=budget)
    seq = add_pooling(sched, list(range(prompt_len)))
    seen = []
    for i in range(len(chunks)):
        out, done = step(sched)
        (s,) = out.seqs
        assert not s.sample
        seen.append((s.start, s.num_new_tokens))
        assert done == ([seq] if i == len(chunks) - 1 else [])
    assert seen == chunks
    assert seq.finish_reason is FinishReason.STOP and seq.num_output_tokens == 0
    assert seq.embedding == pytest.approx([0.5] * HIDDEN)  # ones of every row, normalized
    assert not seq.block_table and not sched.running and not sched.has_unfinished()
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    assert seq.metrics.peak_kv_blocks == -(-prompt_len // BS)
    assert seq.metrics.first_token_time is not None
    assert sched.counters.num_generated_tokens == 0
    assert sched.counters.num_prompt_tokens == prompt_len


def test_pooling_and_generation_share_a_step_under_one_budget() -> None:
    sched = make_scheduler(budget=20)
    gen = add(sched, list(range(5)), max_tokens=3)
    step(sched)
    emb = add_pooling(sched, list(range(100, 130)))
    out, _ = step(sched)
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.seqs] == [
        (gen, 1, True), (emb, 19, False)]
    out, done = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.seqs] == [(gen, 1), (emb, 11)]
    assert done == [gen, emb]  # in batch order; gen reached max_tokens=3 in the same step
    assert gen.output_token_ids == [NEXT_TOKEN] * 3


@pytest.mark.parametrize(("reads_cached_prefix", "cached"), [(True, 32), (False, 0)])
def test_freed_pooling_blocks_stay_in_the_prefix_cache(reads_cached_prefix: bool,
                                                       cached: int) -> None:
    sched = make_scheduler(budget=100)
    prompt = list(range(40))  # two full blocks and a partial one
    first = add_pooling(sched, prompt)
    step(sched)
    assert first.is_finished and sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    again = add_pooling(sched, prompt, reads_cached_prefix=reads_cached_prefix)
    out, done = step(sched)
    assert done == [again]
    assert out.seqs[0].start == cached and again.metrics.num_cached_tokens == cached
    # the pooled sum covers the rows computed in this engine: all of them unless cached
    assert again.pooled is not None and again.pooled[0].item() == 40 - cached


def test_a_pooling_sequence_that_does_not_read_the_cache_does_not_wait_for_one() -> None:
    sched = make_scheduler(budget=20)
    prefix = list(range(48))
    first = add(sched, prefix + [1] * 5)
    emb = add_pooling(sched, prefix + [2] * 5, reads_cached_prefix=False)
    out, _ = step(sched)
    assert [s.seq for s in out.seqs] == [first]  # the budget went to first's chunk
    out, _ = step(sched)
    # a prefix reader would wait for first's blocks; this one computes its own
    assert [(s.seq, s.start) for s in out.seqs] == [(first, 20)]
    out, _ = step(sched)
    assert (emb, 0) in [(s.seq, s.start) for s in out.seqs]


def test_preempted_pooling_sequence_pools_again_from_scratch() -> None:
    sched = make_scheduler(num_blocks=4, budget=16)
    add(sched, list(range(32)), max_tokens=20)  # gen
    step(sched)
    step(sched)  # gen prefilled: 2 blocks
    emb = add_pooling(sched, list(range(100, 132)), reads_cached_prefix=False)
    step(sched)  # gen decodes (a third block), emb's first chunk of 15 tokens
    assert emb.pooled is not None and emb.pooled[0].item() == 15
    for _ in range(8):  # gen's decodes need emb's blocks: emb (the latest) is preempted
        step(sched)
        if emb.metrics.num_preemptions:
            break
    assert emb.metrics.num_preemptions == 1 and emb.pooled is None
    while not emb.is_finished:
        step(sched)
    assert emb.embedding == pytest.approx([0.5] * HIDDEN)
    assert emb.pooled is not None and emb.pooled[0].item() == 32  # each row once
