"""Scheduler bookkeeping without a model: chunking, budgets, prefix dedup, preemption, swap.

The model's place is taken by a fixed next token, which is all the scheduler looks at.
"""

from __future__ import annotations

import time
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.outputs import FinishReason, RequestMetrics
from engine.sampler import Sampled
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelOutput, Scheduler, SchedulerOutput
from engine.sequence import Request, Sequence, SequenceStatus

BS = 16
NEXT_TOKEN = 7


def make_scheduler(
    num_blocks: int = 64, budget: int = 512, max_seqs: int = 16, caching: bool = True,
    swap_blocks: int = 0,
) -> Scheduler:
    config = EngineConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_prefix_caching=caching
    )
    kv = KVCacheManager(num_blocks, BS, caching, num_host_blocks=swap_blocks)
    return Scheduler(config, kv, stop_check=at_max_tokens)


def at_max_tokens(seq: Sequence) -> FinishReason | None:
    return FinishReason.LENGTH if seq.num_output_tokens >= seq.params.max_tokens else None


_order = iter(range(10**9))


def add(sched: Scheduler, prompt: list[int], max_tokens: int = 4, priority: int = 0,
        n: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0 if n == 1 else 1.0)
    metrics = RequestMetrics(arrival_time=time.monotonic())
    seq = Sequence(
        request_id=f"r{len(sched.requests)}",
        prompt_token_ids=prompt,
        params=params,
        metrics=metrics,
        priority=priority,
        arrival_order=next(_order),
    )
    sched.add_request(Request(seq.request_id, prompt, params, metrics, [seq]))
    return seq


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    """One scheduler step with a stand-in model; returns the sequences it finished (at
    max_tokens, in the scheduler's update)."""
    out = sched.schedule()
    sampled = {
        s.seq.seq_id: [Sampled(NEXT_TOKEN, None)] * (1 + s.seq.pending_forks)
        for s in out.seqs
        if s.sample
    }
    update = sched.update(out, ModelOutput(sampled))
    done = [s for s in update.progressed if s.is_finished]
    assert all(s.finish_reason is FinishReason.LENGTH for s in done)
    return out, done


def two_filling_the_pool(swap_blocks: int = 0) -> tuple[Scheduler, Sequence, Sequence]:
    """Two 32-token prompts, prefilled into a pool of 4 blocks: each needs a third block to go
    on, so the next step preempts b (the latest)."""
    sched = make_scheduler(num_blocks=4, budget=100, swap_blocks=swap_blocks)
    a = add(sched, list(range(32)), max_tokens=20)
    b = add(sched, list(range(100, 132)), max_tokens=20)
    step(sched)
    return sched, a, b


def test_chunked_prefill_splits_at_the_budget() -> None:
    sched = make_scheduler(budget=7)
    seq = add(sched, list(range(20)), max_tokens=2)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        (s,) = out.seqs
        chunks.append((s.start, s.num_new_tokens, s.sample))
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 20
    out, _ = step(sched)  # decode of the sampled token
    assert [(s.start, s.num_new_tokens) for s in out.seqs] == [(20, 1)]


def test_running_first_then_waiting_within_budget_and_seat_limit() -> None:
    sched = make_scheduler(budget=10, max_seqs=2)
    a = add(sched, list(range(5)), max_tokens=10)
    step(sched)
    b = add(sched, list(range(100, 120)), max_tokens=10)
    c = add(sched, list(range(200, 203)), max_tokens=10)
    out, _ = step(sched)
    # a decodes (1 token), b takes the other 9 of the budget, c finds no seat.
    assert [(s.seq, s.num_new_tokens) for s in out.seqs] == [(a, 1), (b, 9)]
    assert out.num_decodes == 1 and out.num_batched_tokens == 10
    assert sched.waiting == [c]


def test_decodes_come_first_in_the_batch() -> None:
    sched = make_scheduler(budget=64)
    add(sched, list(range(30)), max_tokens=5)
    step(sched)
    add(sched, list(range(50, 70)), max_tokens=5)
    add(sched, list(range(80, 81)), max_tokens=5)  # a one-token prompt is decode-shaped
    out, _ = step(sched)
    assert [s.num_new_tokens for s in out.seqs] == [1, 1, 20]
    assert out.num_decodes == 2


def test_shared_prefix_in_one_step_is_computed_once() -> None:
    sched = make_scheduler(budget=1000)
    prefix = list(range(48))  # three full blocks
    seqs = [add(sched, prefix + [1000 + i] * 5) for i in range(4)]
    out, _ = step(sched)
    assert [s.num_new_tokens for s in out.seqs] == [53, 5, 5, 5]
    assert [s.metrics.num_cached_tokens for s in seqs] == [0, 48, 48, 48]
    assert sched.counters.num_prompt_tokens == 53 + 3 * 5


def test_waiting_requests_wait_for_a_prefix_being_chunked() -> None:
    sched = make_scheduler(budget=20)
    prefix = list(range(48))
    first = add(sched, prefix + [1] * 5)
    second = add(sched, prefix + [2] * 5)
    for _ in range(2):  # first's chunks 0-20 and 20-40: second waits for blocks 1 and 2
        out, _ = step(sched)
        assert [s.seq for s in out.seqs] == [first]
    out, _ = step(sched)  # first finishes its prompt; second reuses all three blocks
    assert [s.seq for s in out.seqs] == [first, second]
    assert second.metrics.num_cached_tokens == 48
    assert sched.counters.num_prompt_tokens == 53 + 5


def test_preemption_takes_the_latest_and_resumes_it_first() -> None:
    sched, a, b = two_filling_the_pool()
    assert sched.running == [a, b] and sched.kv.pool.num_free_blocks == 0
    out, _ = step(sched)  # a needs a third block: b (latest) is preempted
    assert [s.seq for s in out.seqs] == [a]
    assert sched.waiting[0] is b and b.metrics.num_preemptions == 1
    assert b.block_table == [] and b.num_computed_tokens == 0
    while sched.has_unfinished():
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 20
    assert sched.kv.pool.num_free_blocks == 4


def test_swap_out_keeps_the_computed_tokens_and_swap_in_comes_before_admissions() -> None:
    sched, a, b = two_filling_the_pool(8)
    b_blocks = list(b.block_table)
    out, _ = step(sched)  # a needs a third block: b (latest) is swapped out
    assert [s.seq for s in out.seqs] == [a]
    assert sched.swapped == [b] and b.status is SequenceStatus.SWAPPED
    assert b.block_table == [] and b.num_computed_tokens == 32
    assert out.swap_out == tuple(zip(b_blocks, b.host_block_table, strict=True))
    assert out.swap_in == () and sched.counters.num_swaps == 1
    assert b.metrics.num_preemptions == 1 and sched.counters.num_preemptions == 1
    c = add(sched, list(range(200, 210)), max_tokens=2)  # waits behind the swapped b
    while sched.swapped:
        out, _ = step(sched)
        assert sched.waiting == [c] or not sched.swapped  # admitted once b is back
    host_blocks = [h for h, _ in out.swap_in]
    assert len(host_blocks) == 2 and sched.kv.host_pool.num_free_blocks == 8
    # b resumes where it stopped: a decode of its sampled token, no prompt recomputed.
    (resumed,) = [s for s in out.seqs if s.seq is b]
    assert (resumed.start, resumed.num_new_tokens) == (32, 1)
    assert [d for _, d in out.swap_in] == b.block_table[:2]
    while sched.has_unfinished():
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 20 and c.num_output_tokens == 2
    assert sched.counters.num_prompt_tokens == 32 + 32 + 10


def test_an_urgent_request_goes_before_a_swapped_one() -> None:
    sched, _, b = two_filling_the_pool(8)
    step(sched)
    assert sched.swapped == [b]
    urgent = add(sched, list(range(200, 204)), max_tokens=2, priority=-1)
    while urgent.num_output_tokens == 0:
        step(sched)
        assert sched.swapped == [b]  # the urgent one takes the free block first
    while sched.has_unfinished():
        step(sched)
    assert b.num_output_tokens == 20


def test_full_swap_pool_falls_back_to_recompute() -> None:
    sched, a, b = two_filling_the_pool(1)
    out, _ = step(sched)  # b holds 2 blocks, the host pool 1: b is recomputed
    assert out.swap_out == () and sched.swapped == [] and sched.waiting == [b]
    assert b.num_computed_tokens == 0 and sched.counters.num_swaps == 0
    while sched.has_unfinished():
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 20


def test_swap_in_takes_blocks_still_in_the_prefix_cache() -> None:
    sched = make_scheduler(num_blocks=5, budget=100, swap_blocks=8)
    prefix = list(range(32))  # two full blocks, shared
    a = add(sched, prefix + [1] * 8, max_tokens=30)
    step(sched)
    b = add(sched, prefix + [2] * 8, max_tokens=30)
    step(sched)
    assert b.block_table[:2] == a.block_table[:2]
    shared = a.block_table[:2]
    while not sched.swapped:
        step(sched)
    assert sched.swapped == [b] and len(b.host_block_table) == 3
    while sched.swapped:
        out, _ = step(sched)
    # a still holds the prefix: only b's own block comes back from the host.
    assert b.block_table[:2] == shared and len(out.swap_in) == 1
    while sched.has_unfinished():
        step(sched)
    assert b.num_output_tokens == 30


def test_finishing_a_swapped_sequence_frees_its_host_blocks() -> None:
    sched, _, b = two_filling_the_pool(8)
    step(sched)
    assert sched.swapped == [b] and sched.kv.host_pool.num_free_blocks == 6
    sched.finish([b], FinishReason.ABORT)
    assert sched.swapped == [] and b.host_block_table == []
    assert sched.kv.host_pool.num_free_blocks == 8 and b.is_finished


def test_priority_orders_admission_and_preemption() -> None:
    sched = make_scheduler(num_blocks=4, budget=100, max_seqs=1)
    low = add(sched, list(range(5)), priority=5)
    high = add(sched, list(range(10, 15)), priority=0)
    out, _ = step(sched)
    assert [s.seq for s in out.seqs] == [high]
    assert sched.waiting == [low]


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 70),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(0, 3),  # arrival step
            st.integers(0, 2),  # priority
            st.sampled_from([1, 1, 1, 2, 3]),  # n
            st.integers(0, 2),  # which shared prefix (0 = none)
        ),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(6, 40),
    budget=st.integers(1, 96),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    swap_blocks=st.sampled_from([0, 0, 3, 40]),
)
def test_random_streams_finish_without_leaks(
    requests: list[tuple[int, int, int, int, int, int]],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    caching: bool,
    swap_blocks: int,
) -> None:
    max_seqs = max(max_seqs, 3)  # a request with n = 3 needs three seats
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs,
                           caching=caching, swap_blocks=swap_blocks)
    prefixes = {0: [], 1: list(range(500, 532)), 2: list(range(600, 617))}
    max_len = (num_blocks - 3) * BS  # fits alone, with room for copy-on-write
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    families: list[Sequence] = []
    for step_no in range(2000):
        while pending and pending[0][1][2] <= step_no:
            i, (plen, max_tokens, _, prio, n, pfx) = pending.pop(0)
            prompt = (prefixes[pfx] + [1000 + i] * plen)[: max_len - max_tokens]
            families.append(add(sched, prompt, max_tokens=max_tokens, priority=prio, n=n))
        if not pending and not sched.has_unfinished():
            break
        step(sched)
        _check_invariants(sched)
    else:
        raise AssertionError("scheduler did not finish the requests")

    assert all(r == 0 for r in sched.kv.pool.ref_counts)
    assert sched.kv.pool.num_free_blocks == num_blocks
    if swap_blocks:
        assert sched.kv.host_pool.num_free_blocks == swap_blocks
    for seq in families:
        assert seq.num_output_tokens == seq.params.max_tokens
    # Each preemption counts once, in the step's counters and in its request's figures (the
    # samples of a request share them), however often the same request was preempted.
    per_request = {id(seq.metrics): seq.metrics.num_preemptions for seq in families}
    assert sum(per_request.values()) == sched.counters.num_preemptions


def _check_invariants(sched: Scheduler) -> None:
    pool = sched.kv.pool
    held = Counter(b for seq in sched.running for b in seq.block_table)
    assert all(not seq.block_table for seq in (*sched.waiting, *sched.swapped))
    assert all(not seq.host_block_table for seq in (*sched.waiting, *sched.running))
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == held[block] >= 0
    assert pool.num_free_blocks == pool.num_blocks - len(held)
    host = sched.kv.host_pool
    if host is not None:
        on_host = Counter(b for seq in sched.swapped for b in seq.host_block_table)
        assert all(host.ref_counts[b] == on_host[b] for b in range(host.num_blocks))
        assert all(seq.num_computed_tokens > 0 for seq in sched.swapped)
    assert len(sched.running) <= sched.config.max_num_seqs


def test_update_decides_each_tokens_fate_in_one_pass() -> None:
    """The update appends, checks the stop condition, and finishes and frees what stopped; a
    check that raises fails its request alone (left running for the engine to end), and the
    samples forked this step join their request."""

    def check(seq: Sequence) -> FinishReason | None:
        if seq.request_id == "r1":
            raise ValueError("the grammar refused the token")
        return at_max_tokens(seq)

    sched = make_scheduler()
    sched.stop_check = check
    a = add(sched, list(range(20)), max_tokens=1)
    b = add(sched, list(range(40, 60)), max_tokens=1)
    c = add(sched, list(range(80, 100)), max_tokens=3, n=2)
    out = sched.schedule()
    sampled = {s.seq.seq_id: [Sampled(NEXT_TOKEN, None)] * (1 + s.seq.pending_forks)
               for s in out.seqs}
    update = sched.update(out, ModelOutput(sampled))
    assert [s.request_id for s in update.progressed] == ["r0", "r1", "r2", "r2"]
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH and not a.block_table
    assert a not in sched.running
    assert update.failed == {"r1": "ValueError: the grammar refused the token"}
    assert not b.is_finished and b in sched.running and b.output_token_ids == [NEXT_TOKEN]
    parent, child = sched.requests["r2"].seqs
    assert parent is c and (child.index, child.output_token_ids) == (1, [NEXT_TOKEN])
    assert not c.is_finished and sched.running == [b, c, child]


def test_forked_samples_run_right_after_their_parent() -> None:
    """Samples forked at a request's first token take the seats after their parent, in index
    order, ahead of the requests admitted after it (the order preemption reads backwards)."""
    sched = make_scheduler()
    a = add(sched, list(range(20)), max_tokens=3, n=3)
    b = add(sched, list(range(40, 60)), max_tokens=3)
    step(sched)
    a1, a2 = [s for s in sched.requests[a.request_id].seqs if s is not a]
    assert sched.running == [a, a1, a2, b]
    assert [s.index for s in (a, a1, a2)] == [0, 1, 2]
    assert a1.token_ids == a2.token_ids == a.token_ids == [*range(20), NEXT_TOKEN]
